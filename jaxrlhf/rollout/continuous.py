"""Continuous batching: a decode loop of S slots fed from a queue of N = B·G rows.

The static sampler (`rollout.sampler`) decodes all N rows together until the longest one
ends, so a batch whose response lengths spread (a GRPO group on a reasoning task: 10× or
more) spends most of its steps on rows that are already done. Here S slots decode side by
side; a slot whose row ends (EOS, or T tokens) takes the next row of the queue at once, and
the loop — one `lax.while_loop`, inside the caller's jit — runs until the queue is empty and
every slot is done.

How, so that it samples exactly what `sampler.sample` samples:
- The B prompts are prefilled once, batched, exactly as `sample` does it, and their caches
  (first P slots) and last-token logits are kept. Every row's token 0 is drawn from those
  logits before the loop (a row ending there never takes a slot).
- A slot taking row r copies prompt `b = r // G`'s prefilled cache into its first P cache
  slots (no forward pass for prefill in the loop) and starts at response step 1.
- Each decode step runs the S slots at their own response steps `t_s`: the model takes an
  int32 `[S]` `cache_index` (`P + t_s − 1`), each row's own positions
  (`prompt_len + t_s − 1`) and key mask (its prompt's, then response slots up to its own).
  Cache slots past a row's step still hold the previous row's keys; the mask never lets
  them in. With sliding-window layers the window is on the same slot indices.
- Row r's step t draws the noise of `fold_in(fold_in(rng, r), t)` (the static
  sampler's rule), so greedy and sampled tokens, log-probs and every `SampleOutput` field
  are the static sampler's (up to the float rounding of a batch of S rows instead of N).

The same cache memory as a static batch of S rows; the work saved is that of the finished
rows a static batch carries to its longest one.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from jaxrlhf.models import decode_compiler_options
from jaxrlhf.models.transformer import KVCache, Transformer, init_cache
from jaxrlhf.rollout.sampler import (SampleOutput, _check, _decode_head, _pick, _row_keys, _step_logits, _step_noise,
                                     decode_windows, is_stop, platform_of, prefill, stop_ids, weight_bytes_of)


def check_slots(slots) -> int:
    """`slots` as an int, or a ValueError naming it when it is not a positive integer."""
    if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
        raise ValueError(f"slots must be a positive integer (the sequences decoded at once), got {slots!r}")
    return int(slots)


def _per_layer(fn, cache, *others):
    """`fn(kv, *other_kvs)` on each layer's `KVCache` (one call for a scanned stack's)."""
    if isinstance(cache, KVCache):
        return fn(cache, *others)
    return tuple(fn(*layer) for layer in zip(cache, *others))


def _prompt_part(kv: KVCache, p: int) -> KVCache:
    """The first `p` cache slots (keys `[.., H, S]`, values `[.., S, H]`, either layout)."""
    return KVCache(kv.k[..., :p], kv.v[..., :p, :])


def _copy_prompts(cache, prompt_cache, take_S: jax.Array, b_S: jax.Array):
    """The cache with prompt `b_S[s]`'s prefilled cache in the first P cache slots of every
    slot s where `take_S`; one in-place copy per slot taken (a loop of as many steps as
    slots are taken: most decode steps take none or a few)."""
    slot_S = jnp.nonzero(take_S, size=take_S.shape[0], fill_value=0)[0]

    def one(j, cache):
        slot = slot_S[j]
        put = lambda a, prompt_a: jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.dynamic_index_in_dim(prompt_a, b_S[slot], 0, keepdims=False), slot, 0)
        return _per_layer(lambda kv, pkv: KVCache(put(kv.k, pkv.k), put(kv.v, pkv.v)), cache, prompt_cache)

    return jax.lax.fori_loop(0, take_S.sum(), one, cache)


def sample_continuous(
    model: Transformer,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    slots: int,
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
    """`sampler.sample`'s responses, decoded by `slots` slots fed from the queue of rows.

    Traceable (call it inside your own jit). Arguments and result are `sample`'s (rows
    `b·G + g`, the same padding and log-probs), plus `slots`: S, the rows decoded at once
    (the cache holds S rows of P + T slots); a queue shorter than S uses N slots. The
    queue is the N rows in order; a slot whose row ends takes the next one. `first_row`:
    as in `sample`, this batch's first row in a larger one split by rows (key offset).
    """
    _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len,
           min_new_tokens, eos_id)
    b, p = prompt_ids.shape
    t_max, g = int(max_new_tokens), int(num_samples)
    n = b * g
    s_len = p + t_max
    num_slots = min(check_slots(slots), n)
    prompt_mask = prompt_mask.astype(bool)
    apply = functools.partial(model.apply, {"params": params})
    head_VxD = _decode_head(model, params)  # as `sample`

    # Prefilled as `sample` does (a cache of its first window), so token 0's logits are its own.
    prefill_cache, last_logits = prefill(model, params, prompt_ids, prompt_mask, decode_windows(t_max)[0])
    prompt_cache = _per_layer(lambda kv: _prompt_part(kv, p), prefill_cache)
    prompt_len_B = prompt_mask.sum(axis=1).astype(jnp.int32)

    keys_N = _row_keys(rng, n, first_row) if temperature > 0 else None
    ban_eos = min_new_tokens > 0 and eos_id is not None
    banned = eos_id if ban_eos else None

    def noise(rows, t):  # [rows, M] Gumbel noise of step t (per row), None when greedy
        return None if keys_N is None else _step_noise(keys_N[rows], t, model.config.vocab_size)

    # Token 0 of every row, from its prompt's logits.
    rows_N = jnp.arange(n)
    first_tok, first_logp, first_blogp = _pick(jnp.repeat(last_logits, g, axis=0) if g > 1 else last_logits,
                                               noise(rows_N, jnp.zeros((n,), jnp.int32)), temperature, top_k, top_p,
                                               banned, ban_eos)
    ended = is_stop(first_tok, eos_id) | (t_max == 1)
    # The queue: the rows still going after token 0, in order.
    queue = jnp.argsort(ended, stable=True).astype(jnp.int32)
    queued = (n - ended.sum()).astype(jnp.int32)

    def refill(state, free_S):
        """Free slots take the next queued rows (slot order); slots left without one idle (row n)."""
        pos_S = state["head"] + jnp.cumsum(free_S.astype(jnp.int32)) - 1
        take_S = free_S & (pos_S < queued)
        row_S = jnp.where(take_S, queue[jnp.clip(pos_S, 0, n - 1)], jnp.where(free_S, n, state["row"]))
        b_S = jnp.minimum(row_S, n - 1) // g
        cache = _copy_prompts(state["cache"], prompt_cache, take_S, b_S)
        return dict(state, cache=cache, row=row_S, head=state["head"] + take_S.sum(dtype=jnp.int32),
                    t=jnp.where(take_S, 1, state["t"]),
                    token=jnp.where(take_S, first_tok[jnp.minimum(row_S, n - 1)], state["token"]))

    state = dict(
        cache=init_cache(model.config, num_slots, s_len),
        row=jnp.full((num_slots,), n, jnp.int32),  # the row each slot decodes; n: none
        t=jnp.ones((num_slots,), jnp.int32),  # the response step each slot draws next
        token=jnp.full((num_slots,), pad_id, jnp.int32),  # its last token, the next step's input
        head=jnp.int32(0),  # the queue's next entry
        tokens=jnp.full((n, t_max), pad_id, jnp.int32).at[:, 0].set(first_tok),
        logps=jnp.zeros((n, t_max), jnp.float32).at[:, 0].set(first_logp),
        valid=jnp.zeros((n, t_max), bool).at[:, 0].set(True),
    )
    if first_blogp is not None:  # sampling draws from a truncated distribution: its log-probs too
        state["blogps"] = jnp.zeros((n, t_max), jnp.float32).at[:, 0].set(first_blogp)
    state = refill(state, jnp.ones((num_slots,), bool))
    response_T = jnp.arange(t_max)

    def body(state):
        row_S, t_S = state["row"], state["t"]
        b_S = jnp.minimum(row_S, n - 1) // g
        # The input token is response token t - 1, at cache slot P + t - 1.
        key_valid = jnp.concatenate([prompt_mask[b_S], response_T[None, :] < t_S[:, None]], axis=1)
        out = apply(state["token"][:, None], key_valid, position_ids=(prompt_len_B[b_S] + t_S - 1)[:, None],
                    cache=state["cache"], cache_index=p + t_S - 1, compute_logits=head_VxD is None)
        token, logp, blogp = _pick(_step_logits(model, head_VxD, out), noise(jnp.minimum(row_S, n - 1), t_S),
                                   temperature, top_k, top_p, banned, ban_eos and (t_S < min_new_tokens)[:, None])
        at = lambda x, val: x.at[row_S, t_S].set(val, mode="drop")  # idle slots (row n) write nothing
        done = is_stop(token, eos_id) | (t_S + 1 == t_max)
        next_t = jnp.where(row_S < n, t_S + 1, t_S)  # an idle slot stays put (its cache index in range)
        state = dict(state, cache=out.cache, t=next_t, token=token, tokens=at(state["tokens"], token),
                     logps=at(state["logps"], logp), valid=at(state["valid"], True))
        if blogp is not None:
            state["blogps"] = at(state["blogps"], blogp)
        return refill(state, done | (row_S == n))

    state = jax.lax.while_loop(lambda state: jnp.any(state["row"] < n), body, state)
    repeat = lambda x: jnp.repeat(x, g, axis=0) if g > 1 else x
    prompt_ids, prompt_mask = repeat(prompt_ids), repeat(prompt_mask)
    response_mask = state["valid"]
    return SampleOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=state["tokens"],
        response_mask=response_mask,
        logprobs=state["logps"],
        sequences=jnp.concatenate([prompt_ids, state["tokens"]], axis=1),
        attention_mask=jnp.concatenate([prompt_mask, response_mask], axis=1),
        lengths=response_mask.sum(axis=1).astype(jnp.int32),
        behaviour_logprobs=state.get("blogps"),
    )


@functools.lru_cache(maxsize=64)
def _compiled(model, options: tuple = (), **static):
    """`sample_continuous` jitted with these static arguments and XLA `options`."""
    return jax.jit(functools.partial(sample_continuous, model, **static), compiler_options=dict(options) or None)


def generate_continuous(
    model: Transformer,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    slots: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | tuple[int, ...] | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    max_len: int | None = None,
    min_new_tokens: int = 0,
) -> SampleOutput:
    """`rollout.generate` by continuous batching with `slots` slots; jitted once per shape.

    Same arguments and `SampleOutput` as `generate` (the same tokens for the same key), plus
    `slots`: S, the rows decoded at once, each slot taking the next queued row when its own
    ends. Faster than one static batch where response lengths spread (most rows end early,
    a few run long); one program, no CPU row blocks; compiled as `generate` compiles a
    program of S rows (`models.decode_compiler_options`).
    """
    _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len,
           min_new_tokens, eos_id)
    slots = check_slots(slots)
    rows = min(slots, prompt_ids.shape[0] * int(num_samples))
    options = decode_compiler_options(rows, weight_bytes_of(params), platform_of(params))
    fn = _compiled(model, options, slots=slots, max_new_tokens=int(max_new_tokens),
                   temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                   eos_id=stop_ids(eos_id) or None, pad_id=int(pad_id), num_samples=int(num_samples), max_len=max_len,
                   min_new_tokens=int(min_new_tokens))
    return fn(params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), rng)
