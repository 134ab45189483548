"""One interface for the scores an online algorithm (GRPO, RLOO, PPO) optimises.

Three kinds of reward, all returning one float per response (`N` responses):

- **JAX rewards** on token ids, traced into the compiled iteration:
  `fn(response_ids [N, T], response_mask [N, T], extras) -> [N] float32`, where `extras`
  is a dict of `[N, ...]` arrays (e.g. answer ids), one row per response.
- **Host rewards** on decoded text, run in Python between two compiled programs:
  `fn(prompts: list[str], responses: list[str], extras) -> list[float]` (length N). The
  texts are decoded with the tokenizer given to `host_reward`; a response is decoded up to
  (not including) its first EOS and `extras["finished"]` says whether it had one — unless
  the sampler had no EOS (see below). `trl_reward` takes a function in TRL's
  `reward_funcs` convention instead, `fn(prompts=..., completions=..., **row_fields)`, and
  `import_reward_fn("mypkg.rewards:correct")` finds one by import path. A host reward that
  raises, returns a NaN/inf or the wrong number of scores is an error naming it; a score
  may be a bool (0/1) or None (no score for that response: it adds nothing to the
  total, nor to the component's mean metric). A reward
  function of any kind that calls `sys.exit` is an error naming it, `pkg.mod:fn`
  (`RewardFunctionError`), and a Ctrl-C that interrupts one says which it was. A function
  given by import path can run in a worker process under a timeout
  (`reward_workers.Clocked`, the config's `reward.timeout`).
- **Reward models**: a JAX callable `(sequences [N, P + T], attention_mask [N, P + T]) ->
  [N]` on prompt ⧺ response, e.g. `reward_model.score_fn(model, params)`. Traced like a
  JAX reward (the parameters it closes over become constants of the compiled program),
  or, with `takes_params=True`, `(params, sequences, attention_mask) -> [N]` with the
  parameters given at call time (`device_scores(..., params=...)`), so that they stay an
  argument of the program (`reward_model.as_reward(model)`; PPO keeps them in its state).

One rule for where a response ends, for the loss and every reward: at the sampler's EOS
(`SamplingConfig.eos_id`). The sampler stops there and the loss trains on the tokens up to
and including it; rewards look at what comes before it. With `eos_id=None` nothing ends a
response: the sampler runs to `max_new_tokens`, the loss trains on every token, and an
iteration's host rewards decode every token too (`host_scores(..., cut_at_eos=False)`;
EOS tokens dropped as `skip_special_tokens` does), with `finished` all False.

`combine([(1.0, r1), (0.5, r2)])` sums weighted components; each component's mean is
reported as a metric `reward/<name>`. Whether the combined reward is pure JAX
(`Reward.is_jax`) decides whether an iteration can compile rollout, scoring and update
into one program.

    exact = rewards.jax_reward(lambda ids, mask, ex: data.exact_match_reward(
        ids, mask, ex["answer_ids"], ex["answer_mask"]), name="exact")
    fmt = rewards.host_reward(lambda p, r, ex: [float(s.isdigit()) for s in r], tokenizer, name="digits")
    reward = rewards.combine([(1.0, exact), (0.1, fmt)])
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.reward_workers import Clocked, RewardFunctionError, RewardTimeout, exit_message, import_fn
from jaxrlhf.rollout.sampler import stop_ids, until_stop

KINDS = ("jax", "host", "model")


class RewardInput(NamedTuple):
    """What a reward may look at, all with leading axis `N` (one row per response).

    prompt_ids, prompt_mask: `[N, P]` left-padded prompts (repeated per sample).
    response_ids, response_mask: `[N, T]` right-padded responses (mask 1 up to and
      including EOS).
    sequences, attention_mask: `[N, P + T]`, prompt ⧺ response.
    """

    prompt_ids: Any
    prompt_mask: Any
    response_ids: Any
    response_mask: Any
    sequences: Any
    attention_mask: Any

    @classmethod
    def from_sample(cls, out) -> "RewardInput":
        """From a `rollout.SampleOutput` (or anything with the same fields)."""
        return cls(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, out.sequences,
                   out.attention_mask)

    @classmethod
    def from_sequences(cls, sequences, attention_mask, prompt_len: int) -> "RewardInput":
        """From prompt ⧺ response `[N, P + T]` and the prompt length P (response mask as bool)."""
        return cls(sequences[:, :prompt_len], attention_mask[:, :prompt_len], sequences[:, prompt_len:],
                   attention_mask[:, prompt_len:].astype(bool), sequences, attention_mask)


@dataclasses.dataclass(frozen=True, eq=False)
class Component:
    """One reward: a callable of one of the three `KINDS`, its name and its weight.

    A "model" component with `takes_params` is called `fn(params, sequences,
    attention_mask)`; `vocab_size` (when known) must match the policy's. A host component
    whose score passes `max_abs_score` in absolute value is an error naming the row.
    """

    fn: Callable
    kind: str
    name: str
    weight: float = 1.0
    tokenizer: Any = None
    eos_id: int | tuple[int, ...] | None = None  # the ids that end a response (`sampler.stop_ids`)
    takes_params: bool = False
    vocab_size: int | None = None
    max_abs_score: float | None = None  # a host reward's bound on |score| (None: finite is enough)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"reward {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not callable(self.fn):
            raise TypeError(f"reward {self.name!r}: {self.fn!r} is not callable")
        if self.kind == "host" and self.tokenizer is None:
            raise ValueError(f"host reward {self.name!r} needs a tokenizer to decode the responses")
        if not np.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight}")
        if self.takes_params and self.kind != "model":
            raise ValueError(f"reward {self.name!r}: only a reward model takes its parameters at call time")

    @property
    def is_jax(self) -> bool:
        return self.kind in ("jax", "model")


def origin(fn: Callable) -> str:
    """`pkg.mod:fn`, where reward function `fn` (or the function it wraps) is defined; a
    function run in a worker (`reward_workers.Clocked`) by its import path."""
    fn = inspect.unwrap(fn)
    if getattr(fn, "import_path", None):
        return fn.import_path
    return f"{getattr(fn, '__module__', None) or '?'}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _call(c: Component, *args):
    """`c.fn(*args)`, user code: a `sys.exit` inside is a `RewardFunctionError` naming the
    function, and a Ctrl-C inside a KeyboardInterrupt that names it (the command line's
    last line)."""
    try:
        return c.fn(*args)
    except SystemExit as e:
        raise RewardFunctionError(exit_message(origin(c.fn), e.code)) from e
    except KeyboardInterrupt as e:
        raise KeyboardInterrupt(f"while running reward function {origin(c.fn)}") from e


def _check_scores(name: str, scores, n: int, host: bool):
    """The `[N]` float scores of reward `name`, or a ValueError saying what came back."""
    shape = np.shape(scores)
    dtype = np.asarray(scores).dtype if host else jnp.asarray(scores).dtype
    if shape != (n,):
        raise ValueError(f"reward {name!r} returned shape {shape}; expected [N] = ({n},), one score per "
                         "response")
    if not (jnp.issubdtype(dtype, jnp.floating) or (host and jnp.issubdtype(dtype, jnp.integer))):
        raise ValueError(f"reward {name!r} returned dtype {dtype}; expected float32 scores "
                         "(cast with .astype(jnp.float32))")
    return np.asarray(scores, np.float32) if host else jnp.asarray(scores, jnp.float32)


def _host_values(name: str, scores, n: int) -> np.ndarray:
    """The `[N]` float32 scores a host reward returned: numbers, `bool` as 0/1, `None` as
    NaN (no score for that row, TRL's convention); a ValueError saying what came back
    otherwise (the wrong length, something not a number, NaN or inf)."""
    none = None
    if isinstance(scores, (list, tuple)) or (isinstance(scores, np.ndarray) and scores.dtype == object):
        values = list(scores)
        none = np.asarray([v is None for v in values], bool)
        scores = [0.0 if v is None else v for v in values]
    try:
        array = np.asarray(scores)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"reward {name!r} returned {type(scores).__name__} that is not an [N] array of floats: "
                         f"{e}") from None
    if array.dtype == bool:
        array = array.astype(np.float32)
    if array.dtype == object:
        raise ValueError(f"reward {name!r} returned non-numeric scores; expected {n} floats (or None for no score)")
    array = _check_scores(name, array, n, host=True)
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(f"reward {name!r} returned {array[bad[0]]} for response {bad[0]} ({bad.size} of {n} "
                         "scores not finite); return finite floats (None: no score for that response)")
    if none is not None and none.any():
        array = array.copy()
        array[none] = np.nan
    return array


def _scored(c: Component, scores) -> tuple[jax.Array, jax.Array]:
    """(`[N]` float32 scores with 0 where there is none, `[N]` 1.0 where there is one): only
    a host component can leave a row unscored (NaN, its function's None)."""
    values = jnp.asarray(scores, jnp.float32)
    if c.kind != "host":
        return values, jnp.ones_like(values)
    scored = ~jnp.isnan(values)
    return jnp.where(scored, values, 0.0), scored.astype(jnp.float32)


def _decode(tokenizer, ids_NxL, mask_NxL, eos_id, *, cut: bool = True):
    """Texts of the valid tokens of each row, cut before the first EOS (any of `eos_id`'s
    ids, `sampler.stop_ids`), and `finished` [N]. With `cut=False` every valid token is
    decoded except the EOS tokens themselves (removed before decoding: a tokenizer may stop
    at EOS on its own), `finished` False."""
    texts, finished = [], []
    for row, m in zip(np.asarray(ids_NxL), np.asarray(mask_NxL).astype(bool)):
        valid, done = until_stop(row[m].tolist(), eos_id) if cut else (row[m].tolist(), False)
        if not cut:
            valid = [t for t in valid if t not in stop_ids(eos_id)]
        texts.append(tokenizer.decode(valid, skip_special_tokens=True))
        finished.append(done)
    return texts, np.asarray(finished, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class Reward:
    """A weighted sum of reward components (build it with `combine` or the constructors).

    `device_scores` traces the JAX components, `host_scores` runs the host ones on numpy
    arrays, `total` sums weighted components: `total({**device, **host})` is the reward.
    """

    components: tuple[Component, ...]

    def __post_init__(self):
        if not self.components:
            raise ValueError("a reward needs at least one component")
        names = [c.name for c in self.components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward component names must be unique, got duplicates {dupes}; pass name=...")

    @property
    def is_jax(self) -> bool:
        """True when every component can run inside a compiled program (no host reward)."""
        return all(c.is_jax for c in self.components)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)

    def device_scores(self, inputs: RewardInput, extras: Mapping[str, Any], params: Any = None
                      ) -> dict[str, jax.Array]:
        """`{name: [N] float32}` of the JAX and reward-model components (traceable);
        `params` go to every component that `takes_params` (they share them), if any."""
        n = inputs.response_ids.shape[0]
        out = {}
        for c in self.components:
            if c.kind == "jax":
                scores = _call(c, inputs.response_ids, inputs.response_mask, dict(extras))
            elif c.takes_params:
                if params is None:
                    raise ValueError(f"reward {c.name!r} takes its parameters at call time: pass params=...")
                scores = _call(c, params, inputs.sequences, inputs.attention_mask)
            elif c.kind == "model":
                scores = _call(c, inputs.sequences, inputs.attention_mask)
            else:
                continue
            out[c.name] = _check_scores(c.name, scores, n, host=False)
        return out

    def host_scores(self, inputs: RewardInput, extras: Mapping[str, Any], *,
                    cut_at_eos: bool = True, drop_unscored: bool = False) -> dict[str, np.ndarray]:
        """`{name: [N] float32}` of the host components (numpy inputs; runs Python).

        `cut_at_eos=False`: the responses come from a sampler without EOS (`eos_id=None`),
        which the loss trains on whole: decode them whole too (the module's rule).
        A row that every weighted component leaves unscored (`scored`) is an error naming
        it; with `drop_unscored=True` (the caller drops such rows: GRPO, PPO) only a batch with
        no scored row at all is.
        """
        n = np.shape(inputs.response_ids)[0]
        out = {}
        for c in self.components:
            if c.kind != "host":
                continue
            eos = c.eos_id
            if eos is None:
                eos = getattr(c.tokenizer, "eos_id", getattr(c.tokenizer, "eos_token_id", None))
            responses, finished = _decode(c.tokenizer, inputs.response_ids, inputs.response_mask, eos,
                                          cut=cut_at_eos)
            prompts, _ = _decode(c.tokenizer, inputs.prompt_ids, inputs.prompt_mask, None)
            ex = {k: np.asarray(v) if hasattr(v, "shape") else v for k, v in extras.items()}
            ex.setdefault("finished", finished)
            try:
                scores = _call(c, prompts, responses, ex)
            except RewardFunctionError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure of user code, named
                raise RuntimeError(f"reward {c.name!r} raised {type(e).__name__}: {e}") from e
            scores = _host_values(c.name, scores, n)
            bound = c.max_abs_score
            big = np.flatnonzero(np.abs(scores) > bound) if bound is not None else ()
            if len(big):
                i = int(big[0])
                raise ValueError(f"reward function {origin(c.fn)} returned {scores[i]:g} for row {i} (prompt "
                                 f"{prompts[i][:80]!r}); |score| may be at most {bound:g} (reward.max_abs_score): "
                                 "scale the scores, or raise the bound")
            clock = inspect.unwrap(c.fn)
            if isinstance(clock, Clocked):  # `reward/<name>/timeouts`: 1 where its call timed out (scored 0)
                out[f"{c.name}/timeouts"] = np.full(n, float(clock.timed_out), np.float32)
            out[c.name] = scores
        weighted = [c for c in self.components if c.weight != 0]
        if out and weighted and all(c.kind == "host" for c in weighted):
            unscored = np.flatnonzero(~np.asarray(self.scored(out)))
            if unscored.size == n and drop_unscored:
                raise ValueError(f"no row of the batch has a score: every reward with a weight "
                                 f"({', '.join(origin(c.fn) for c in weighted)}) returned None for all {n} rows; "
                                 "there is nothing to learn from: score some, or give the task's own reward a "
                                 "weight (reward.task_weight > 0)")
            if unscored.size and not drop_unscored:
                i = int(unscored[0])
                raise ValueError(f"row {i} (prompt {prompts[i][:80]!r}) has no score: every reward with a weight "
                                 f"({', '.join(c.name for c in weighted)}) returned None for it ({unscored.size} of "
                                 f"{n} rows); a response without any score cannot be trained on: score it, or give "
                                 "the task's own reward a weight (reward.task_weight > 0)")
        return out

    def total(self, scores: Mapping[str, Any]) -> jax.Array:
        """`Σ_i w_i · scores[name_i]`, float32 `[N]` (jnp, so it works inside jit); a host
        component's NaN (its function's None: no score for that row) adds nothing."""
        missing = [c.name for c in self.components if c.name not in scores]
        if missing:
            raise KeyError(f"scores of reward components {missing} are missing")
        return sum(jnp.float32(c.weight) * _scored(c, scores[c.name])[0] for c in self.components)

    def scored(self, scores: Mapping[str, Any]) -> jax.Array:
        """`[N]` bool: False on the rows that every weighted component leaves unscored (each
        a host component whose function returned None), True elsewhere (everywhere when a
        weighted component is not a host one, or when no component has a weight)."""
        weighted = [c for c in self.components if c.weight != 0]
        if weighted and all(c.kind == "host" for c in weighted):
            return jnp.any(jnp.stack([_scored(c, scores[c.name])[1] > 0 for c in weighted]), axis=0)
        return jnp.ones(jnp.shape(scores[self.components[0].name]), bool)

    def metrics(self, scores: Mapping[str, Any]) -> dict[str, jax.Array]:
        """`{"reward/<name>": mean}` for every component (unweighted means; a host
        component's over the rows it scored, 0 when none), and `reward/<name>/timeouts` for a
        function run under a clock (1 when its call timed out and scored 0)."""
        out = {}
        for c in self.components:
            values, scored = _scored(c, scores[c.name])
            out[f"reward/{c.name}"] = (jnp.sum(values) / jnp.maximum(jnp.sum(scored), 1.0) if c.kind == "host"
                                       else jnp.mean(values))
            if f"{c.name}/timeouts" in scores:
                out[f"reward/{c.name}/timeouts"] = jnp.max(jnp.asarray(scores[f"{c.name}/timeouts"], jnp.float32))
        return out

    def __call__(self, inputs: RewardInput, extras: Mapping[str, Any] | None = None, params: Any = None):
        """Eager evaluation of every component: `(total [N], {name: [N]})`.

        Convenient on host; inside jit use `device_scores` (the host part cannot trace).
        """
        extras = {} if extras is None else extras
        dev_extras = {k: v for k, v in extras.items() if hasattr(v, "shape")}
        scores = dict(self.device_scores(inputs, dev_extras, params))
        if not self.is_jax:
            scores.update(self.host_scores(jax.tree.map(np.asarray, inputs), extras))
        return self.total(scores), scores


def _name(fn, name):
    return name or getattr(fn, "__name__", None) or type(fn).__name__


def jax_reward(fn: Callable, *, name: str | None = None, weight: float = 1.0) -> Reward:
    """A reward on token ids, traced into the compiled step:
    `fn(response_ids [N, T], response_mask [N, T], extras) -> [N] float32`."""
    return Reward((Component(fn, "jax", _name(fn, name), float(weight)),))


def host_reward(fn: Callable, tokenizer, *, name: str | None = None, weight: float = 1.0,
                eos_id: int | tuple[int, ...] | None = None) -> Reward:
    """A reward on decoded text, run in Python:
    `fn(prompts: list[str], responses: list[str], extras) -> list[float]`.

    `tokenizer.decode(ids, skip_special_tokens=True)` decodes (CharTokenizer or a Hugging
    Face tokenizer); responses are cut before the first `eos_id` (one id or several, e.g.
    a chat model's `<|im_end|>` and `<|endoftext|>`; default: the tokenizer's), and `extras["finished"]` `[N]` bool says whether it was emitted.
    """
    return Reward((Component(fn, "host", _name(fn, name), float(weight), tokenizer, eos_id),))


def trl_reward(fn: Callable, tokenizer, *, name: str | None = None, weight: float = 1.0,
               eos_id: int | None = None, max_abs_score: float | None = None) -> Reward:
    """A host reward in TRL's `reward_funcs` convention, so that reward functions written
    for TRL run unchanged: `fn(prompts=[...], completions=[...], **fields) -> list[float]`,
    called with keywords, one entry per response in every list. `fields` are the reward
    extras except `finished` — for the text tasks, the other fields of each prompt's row
    (e.g. `answer`), repeated for its samples. Decoding as in `host_reward`. As in TRL, a
    score may be a `bool` (0/1) or `None`: no score for that response, left out of this
    reward's term (it adds 0) and of its `reward/<name>` mean; a row no weighted reward
    scores (`Reward.scored`) is dropped from a GRPO or PPO update (`reward/dropped`) and
    left out of the held-out evaluation's `reward`. A score above `max_abs_score` in absolute value is an error naming
    the row. `fn` may be a `reward_workers.Clocked`: the function runs in a worker process
    under a timeout."""
    def call(prompts, responses, extras):
        fields = {k: list(v) for k, v in extras.items() if k != "finished"}
        return fn(prompts=prompts, completions=responses, **fields)

    call.__wrapped__ = fn  # the function that errors name (`origin`)
    reward = host_reward(call, tokenizer, name=_name(fn, name), weight=weight, eos_id=eos_id)
    return Reward((dataclasses.replace(reward.components[0], max_abs_score=max_abs_score),))


def import_reward_fn(spec: str) -> Callable:
    """The callable at import path `spec`, "package.module:function" (a dotted attribute
    path after the colon works too); a ValueError naming `spec` when it does not import, has
    no such attribute or is not callable (`reward_workers.import_fn`)."""
    return import_fn(spec)


def model_reward(score_fn: Callable, *, name: str = "reward_model", weight: float = 1.0, takes_params: bool = False,
                 vocab_size: int | None = None) -> Reward:
    """A reward model: `score_fn(sequences [N, P + T], attention_mask [N, P + T]) -> [N]`.

    With `takes_params=True` it is `score_fn(params, sequences, attention_mask)`, the
    parameters passed to `device_scores` (every such component of a reward gets the same
    params: e.g. an ensemble's reduced score and its members' disagreement).
    `vocab_size`, when given, is the reward model's (checked against the policy's).
    """
    return Reward((Component(score_fn, "model", name, float(weight), takes_params=takes_params,
                             vocab_size=vocab_size),))


def as_reward(reward) -> Reward:
    """A `Reward` as is; a bare callable as a JAX reward on token ids."""
    if isinstance(reward, Reward):
        return reward
    if callable(reward):
        return jax_reward(reward)
    raise TypeError(f"expected a rewards.Reward or a callable, got {type(reward).__name__}")


def combine(weighted: Sequence[tuple[float, Any]]) -> Reward:
    """`Σ_i w_i · r_i` from `[(w_1, r_1), ...]`; each `r_i` is a `Reward` (its components'
    weights are multiplied by `w_i`) or a bare JAX reward callable."""
    if not weighted:
        raise ValueError("combine needs at least one (weight, reward) pair")
    parts = []
    for item in weighted:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"combine takes (weight, reward) pairs, got {item!r}")
        weight, reward = item
        for c in as_reward(reward).components:
            parts.append(dataclasses.replace(c, weight=float(weight) * c.weight))
    return Reward(tuple(parts))


__all__ = ["KINDS", "Component", "Reward", "RewardFunctionError", "RewardInput", "RewardTimeout", "as_reward", "combine",
           "host_reward", "import_reward_fn", "jax_reward", "model_reward", "origin", "trl_reward"]
