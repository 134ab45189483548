"""Episodes: multi-turn rollouts with an environment, whose tokens are the sampled ones.

An episode is one token sequence: the prompt (the environment's `reset`), then turns of
policy tokens, each followed by the environment's tokens (`TokenEnv.step`: a tool result,
a user's reply, the chat template's glue). The sequence a trainer scores is built from the
ids themselves — the policy's tokens exactly as sampled, the environment's exactly as it
returned them — so no text is ever re-tokenised (a re-tokenisation can differ from the
sampled ids and would train on a sequence nobody sampled: docs/episodes.md#exact-tokens).

How it runs (`run_episodes`), for N episodes side by side:
- The prompts are left-padded to P and prefilled once into a cache of
  `S = P + R + C + 1` slots per row (R = `max_total_tokens`, C the longest environment
  chunk, one scratch slot). Every row then writes at its own slots (the model's per-row
  `cache_index`, as in `rollout.continuous`): response token i of a row sits at slot P + i,
  its position is `prompt_len + i`, and the slots of a row are never re-filled: the
  environment's tokens are **appended as a prefill chunk to the episode's own cache**, the
  history is never prefilled again.
- A turn is one compiled `lax.while_loop` (`_decode_turn`): each step, the rows still in
  their turn draw a token from their logits (the sampler's `_pick`, with row r's k-th
  policy token drawn with the noise of `fold_in(fold_in(rng, r), k)`), write it, and —
  unless it ended the turn (a stop id, `max_turn_tokens`, or the episode's token budget) —
  feed it to get the next logits. Rows that are not drawing write into the scratch slot.
- The turn's last token is not fed in the loop: it opens the next chunk,
  `[last policy token] ⧺ environment ids`, one forward pass over the rows that go on
  (`_extend`, compiled per chunk length, a power of two), whose logits at the chunk's last
  real token start the next turn.
- On the host between turns: the environments' `step`s, checks and limits. An episode ends
  when its environment says done (reward: the sum of its steps' rewards), or at a limit —
  `max_turns` turns, `max_total_tokens` tokens (policy + environment), an environment chunk
  over `max_env_tokens` (or an `envs.EnvLimit`) — with `cut_reward` as its reward and the
  limit counted (`EpisodeOutput.cut`).

What comes out (`EpisodeOutput.sample`, a `SampleOutput` of N rows of host (NumPy) arrays,
response length R):
`response_ids` all the episode's tokens after the prompt, `response_mask` the **policy
mask** (the tokens the policy sampled: the loss, KL, entropy and GRPO's advantages count
these only; it has holes where the environment's tokens are), `attention_mask` the prompt ⧺
every real token (policy and environment), `logprobs` the sampler's log-probs on policy
tokens (0 elsewhere: the trainer recomputes exactly these, `ops.token_logprobs` over the
same sequence), `lengths` the policy tokens of each row.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import envs as envs_lib
from jaxrlhf.models.transformer import Transformer, _cache_slots, project_logits
from jaxrlhf.rollout.sampler import SampleOutput, _pick, _row_keys, _step_noise, is_stop, prefill, stop_ids

LIMITS = ("turns", "tokens", "env_tokens")  # what can cut an episode (`EpisodeOutput.cut`)


class EpisodeOutput(NamedTuple):
    """N episodes (rows of `sample`, `[N, P]` prompts and `[N, R]` responses).

    sample: the `SampleOutput` a trainer scores (module docstring: `response_mask` is the
      policy mask, `attention_mask` covers the environment's tokens too).
    env_mask: `[N, R]` bool numpy, the environment's tokens.
    rewards: `[N]` float32 numpy, each episode's reward (the sum of its steps' rewards, or
      `cut_reward` for an episode cut by a limit).
    turns: `[N]` int32 numpy, the policy turns of each episode.
    cut: per episode, the limit that ended it (one of `LIMITS`) or None (its environment said done).
    prefill_tokens: `[N]` int32 numpy, the tokens each episode's cache took in prefill
      passes: its prompt plus its environment tokens (never a re-prefill of its history).
    stats: per-episode host figures for metrics (`episode_metrics`): `env_seconds`
      (`[N]` float64, time in the environment's `step`s).
    """

    sample: SampleOutput
    env_mask: np.ndarray
    rewards: np.ndarray
    turns: np.ndarray
    cut: list
    prefill_tokens: np.ndarray
    stats: dict


_prefill = jax.jit(prefill, static_argnums=(0, 4))


def _bucket(n: int) -> int:
    """The smallest power of two >= n (chunk lengths compile once per bucket)."""
    return 1 << max(0, int(n) - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("model", "max_turn_tokens", "temperature", "top_k", "top_p", "eos_id"))
def _decode_turn(model: Transformer, params, state: dict, keys_N, prompt_mask, prompt_len_N, *, max_turn_tokens: int,
                 temperature: float, top_k: int, top_p: float, eos_id):
    """One turn of every row in `state["active"]`: draw, write, feed, until each row ends
    its turn (module docstring). `state`: cache, logits `[N, V]`, tokens/logps/policy
    `[N, R]`, pos `[N]` (tokens in the buffer), drawn `[N]` (policy tokens drawn so far),
    active `[N]`."""
    n, r = state["tokens"].shape
    p = prompt_mask.shape[1]
    s = _cache_slots(model.config, state["cache"])
    resp_slot = jnp.arange(s - p)[None, :]
    rows = jnp.arange(n)

    def cond(st):
        return jnp.any(st["active"])

    def body(st):
        active, pos = st["active"], st["pos"]
        noise = None if keys_N is None else _step_noise(keys_N, st["drawn"], model.config.vocab_size)
        token, logp, _ = _pick(st["logits"], noise, temperature, top_k, top_p)  # (behaviour: not tracked)
        at = jnp.where(active, pos, r)  # idle rows write nothing (index r is dropped)
        put = lambda buf, v: buf.at[rows, at].set(v, mode="drop")
        new_pos = pos + active
        turn_t = st["turn_t"] + active
        ended = active & (is_stop(token, eos_id) | (turn_t >= max_turn_tokens) | (new_pos >= r))
        feed = active & ~ended
        key_valid = jnp.concatenate([prompt_mask, resp_slot < new_pos[:, None]], axis=1)
        out = model.apply({"params": params}, jnp.where(feed, token, 0)[:, None], key_valid,
                          position_ids=(prompt_len_N + new_pos - 1)[:, None], cache=st["cache"],
                          cache_index=jnp.where(feed, p + new_pos - 1, s - 1))
        logits = jnp.where(feed[:, None], out.logits[:, 0].astype(jnp.float32), st["logits"])
        return dict(st, cache=out.cache, logits=logits, tokens=put(st["tokens"], token), logps=put(st["logps"], logp),
                    policy=put(st["policy"], True), pos=new_pos, drawn=st["drawn"] + active, turn_t=turn_t,
                    active=feed)

    out = jax.lax.while_loop(cond, body, dict(state, turn_t=jnp.zeros((n,), jnp.int32)))
    out.pop("turn_t")
    return out


@functools.partial(jax.jit, static_argnames=("model",))
def _extend(model: Transformer, params, cache, chunk_NxL, chunk_len_N, fed_N, prompt_mask, prompt_len_N, logits_NxV):
    """Append each row's chunk (`chunk_len_N[i]` real tokens of `chunk_NxL`, 0: none) to its
    cache after its `fed_N[i]` response tokens, in one forward pass; the logits at each
    chunk's last real token replace that row's `logits_NxV`."""
    n, l = chunk_NxL.shape
    p = prompt_mask.shape[1]
    s = _cache_slots(model.config, cache)
    go = chunk_len_N > 0
    resp_slot = jnp.arange(s - p)[None, :]
    key_valid = jnp.concatenate([prompt_mask, resp_slot < (fed_N + chunk_len_N)[:, None]], axis=1)
    out = model.apply({"params": params}, chunk_NxL, key_valid,
                      position_ids=(prompt_len_N + fed_N)[:, None] + jnp.arange(l)[None, :], cache=cache,
                      cache_index=jnp.where(go, p + fed_N, s - l), compute_logits=False)
    last = jnp.take_along_axis(out.hidden, jnp.maximum(chunk_len_N - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = project_logits(model.config, params, last).astype(jnp.float32)
    return out.cache, jnp.where(go[:, None], logits, logits_NxV)


def run_episodes(
    model: Transformer,
    params,
    envs: Sequence[Any],
    rows: Sequence[dict],
    rng: jax.Array,
    *,
    max_turns: int,
    max_turn_tokens: int,
    max_total_tokens: int,
    max_env_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | tuple[int, ...] | None = None,
    pad_id: int = 0,
    cut_reward: float = 0.0,
    prompt_multiple: int = 8,
    prompt_len: int | None = None,
    prompt_field: str = "prompt_len",
) -> EpisodeOutput:
    """Run one episode per environment: `envs[i]` (a `TokenEnv`; reset with `rows[i]`,
    closed at the end whatever happens), sampled with `rng` (module docstring).

    Args:
      max_turns: policy turns at most; an episode whose environment is not done after its
        last allowed turn is cut ("turns").
      max_turn_tokens: tokens of one policy turn at most; a turn that reaches it without a
        stop id is given to the environment as `cut`.
      max_total_tokens: R, the episode's tokens after the prompt (policy + environment).
      max_env_tokens: one environment chunk's tokens at most (a longer one cuts the episode:
        "env_tokens").
      temperature, top_k, top_p: as `sampler.generate`; the log-probs are of
        softmax(logits/τ) before truncation.
      eos_id: the ids that end a policy turn (e.g. the template's end-of-turn token).
      pad_id: fills the buffers past each episode's end.
      cut_reward: the reward of an episode cut by a limit.
      prompt_multiple: P is rounded up to a multiple of this (fewer compiles).
      prompt_len: the longest prompt allowed; P is then this rounded up, the same for every
        call (one compile for every batch); a longer prompt is a ValueError naming
        `prompt_field`. None: P is the batch's longest prompt rounded up.
    """
    if len(envs) != len(rows):
        raise ValueError(f"run_episodes: {len(envs)} environments for {len(rows)} rows; one row per environment")
    for name, v in [("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens),
                    ("max_total_tokens", max_total_tokens), ("max_env_tokens", max_env_tokens)]:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"run_episodes: {name} must be a positive integer, got {v!r}")
    if not stop_ids(eos_id):
        raise ValueError("run_episodes: eos_id must name the token(s) that end a policy turn")
    n, r = len(envs), int(max_total_tokens)
    try:
        return _run(model, params, envs, rows, rng, n, r, max_turns=max_turns, max_turn_tokens=max_turn_tokens,
                    max_env_tokens=max_env_tokens, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                    pad_id=pad_id, cut_reward=cut_reward, prompt_multiple=prompt_multiple, prompt_len=prompt_len,
                    prompt_field=prompt_field)
    finally:
        errors = []
        for env in envs:
            try:
                envs_lib.close(env)
            except envs_lib.EnvError as e:  # every env is closed; the first failure is reported
                errors.append(e)
        if errors:
            raise errors[0]


def _run(model, params, envs, rows, rng, n, r, *, max_turns, max_turn_tokens, max_env_tokens, temperature, top_k,
         top_p, eos_id, pad_id, cut_reward, prompt_multiple, prompt_len, prompt_field):
    prompts = [envs_lib.check_ids(env, "reset", envs_lib.call(env, "reset", row)) for env, row in zip(envs, rows)]
    for env, ids in zip(envs, prompts):
        if not ids:
            raise envs_lib.EnvError(f"{envs_lib.name_of(env)}.reset returned no tokens; an episode needs a prompt")
    vocab = model.config.vocab_size
    longest = max(map(len, prompts))
    if prompt_len is not None and longest > prompt_len:
        raise ValueError(f"an episode's prompt (its environment's reset) has {longest} tokens, over "
                         f"{prompt_field}={prompt_len}: raise it")
    p = -(-(longest if prompt_len is None else prompt_len) // prompt_multiple) * prompt_multiple
    prompt_ids = np.full((n, p), pad_id, np.int32)
    prompt_mask = np.zeros((n, p), bool)
    for i, ids in enumerate(prompts):
        prompt_ids[i, p - len(ids):] = ids
        prompt_mask[i, p - len(ids):] = True
    if prompt_ids.max() >= vocab:
        raise envs_lib.EnvError(f"{envs_lib.name_of(envs[0])}.reset returned a token id >= the vocabulary ({vocab})")
    chunk_max = _bucket(max_env_tokens + 1)
    s = p + r + chunk_max + 1
    prompt_mask_dev = jnp.asarray(prompt_mask)
    cache, logits = _prefill(model, params, jnp.asarray(prompt_ids), prompt_mask_dev, s - p)
    prompt_len = jnp.asarray(prompt_mask.sum(axis=1), jnp.int32)
    keys = _row_keys(rng, n) if temperature > 0 else None
    state = dict(cache=cache, logits=logits.astype(jnp.float32), tokens=jnp.full((n, r), pad_id, jnp.int32),
                 logps=jnp.zeros((n, r), jnp.float32), policy=jnp.zeros((n, r), bool), pos=jnp.zeros((n,), jnp.int32),
                 drawn=jnp.zeros((n,), jnp.int32), active=jnp.ones((n,), bool))
    del cache

    pos = np.zeros(n, np.int64)  # the host's copy of state["pos"]
    rewards = np.zeros(n, np.float64)
    turns = np.zeros(n, np.int32)
    cut: list = [None] * n
    done = np.zeros(n, bool)
    env_mask = np.zeros((n, r), bool)
    prefill_tokens = np.array([len(x) for x in prompts], np.int32)
    env_seconds = np.zeros(n, np.float64)
    stops = set(stop_ids(eos_id))
    decode = functools.partial(_decode_turn, model, max_turn_tokens=int(max_turn_tokens), temperature=float(temperature),
                               top_k=int(top_k), top_p=float(top_p),
                               eos_id=tuple(stop_ids(eos_id)))
    while not done.all():
        start = pos.copy()
        state = decode(params, state, keys, prompt_mask_dev, prompt_len)
        tokens = np.asarray(state["tokens"])
        pos = np.asarray(state["pos"]).astype(np.int64)
        turn_end = pos.copy()  # each row's last policy token is at turn_end - 1, not fed yet
        chunk_ids = np.full((n, chunk_max), pad_id, np.int32)
        chunk_len = np.zeros(n, np.int32)
        for i in np.flatnonzero(~done):
            action = tokens[i, start[i]:pos[i]].tolist()
            turns[i] += 1
            stopped = bool(action) and action[-1] in stops
            if not stopped and pos[i] >= r:  # the episode's token budget ran out mid-turn
                done[i], cut[i] = True, "tokens"
                continue
            t0 = time.perf_counter()
            try:
                step = envs_lib.check_token_step(envs[i], envs_lib.call(envs[i], "step", action, not stopped))
            except envs_lib.EnvLimit as e:
                done[i], cut[i] = True, e.kind if e.kind in LIMITS else "env_tokens"
                continue
            finally:
                env_seconds[i] += time.perf_counter() - t0
            rewards[i] += step.reward
            if step.done:
                done[i] = True
                continue
            if turns[i] >= max_turns:
                done[i], cut[i] = True, "turns"
                continue
            if len(step.ids) > max_env_tokens:
                done[i], cut[i] = True, "env_tokens"
                continue
            if pos[i] + len(step.ids) >= r:  # no room for the environment's tokens and one more policy token
                done[i], cut[i] = True, "tokens"
                continue
            if step.ids and max(step.ids) >= vocab:
                raise envs_lib.EnvError(f"{envs_lib.name_of(envs[i])}.step returned a token id >= the vocabulary "
                                        f"({vocab})")
            chunk_ids[i, 0] = action[-1]
            chunk_ids[i, 1:1 + len(step.ids)] = step.ids
            chunk_len[i] = 1 + len(step.ids)
            env_mask[i, pos[i]:pos[i] + len(step.ids)] = True
            prefill_tokens[i] += len(step.ids)
            pos[i] += len(step.ids)
        if done.all():
            break
        go = chunk_len > 0
        width = _bucket(int(chunk_len.max()))
        cache, logits = _extend(model, params, state["cache"], jnp.asarray(chunk_ids[:, :width]), jnp.asarray(chunk_len),
                                jnp.asarray(np.where(go, turn_end - 1, 0), jnp.int32),
                                prompt_mask_dev, prompt_len, state["logits"])
        tokens = tokens.copy()
        for i in np.flatnonzero(go):
            tokens[i, turn_end[i]:pos[i]] = chunk_ids[i, 1:chunk_len[i]]
        state.update(cache=cache, logits=logits, tokens=jnp.asarray(tokens), pos=jnp.asarray(pos, jnp.int32),
                     active=jnp.asarray(go))
    rewards[[c is not None for c in cut]] = cut_reward  # an episode cut by a limit: its steps' rewards replaced
    return _output(state, prompt_ids, prompt_mask, env_mask, rewards, turns, cut, prefill_tokens, env_seconds, r, pad_id)


def _output(state, prompt_ids, prompt_mask, env_mask, rewards, turns, cut, prefill_tokens, env_seconds, r, pad_id):
    policy = np.asarray(state["policy"])
    valid = policy | env_mask
    tokens = np.where(valid, np.asarray(state["tokens"]), pad_id).astype(np.int32)
    logps = np.where(policy, np.asarray(state["logps"]), 0.0).astype(np.float32)
    sample = SampleOutput(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens, response_mask=policy, logprobs=logps,
        sequences=np.concatenate([prompt_ids, tokens], axis=1),
        attention_mask=np.concatenate([prompt_mask, valid], axis=1), lengths=policy.sum(axis=1).astype(np.int32))
    return EpisodeOutput(sample=sample, env_mask=env_mask, rewards=rewards.astype(np.float32), turns=turns, cut=cut,
                         prefill_tokens=prefill_tokens, stats=dict(env_seconds=env_seconds))
