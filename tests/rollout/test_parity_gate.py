"""Sampler = trainer: the gate asynchronous RL stands on, for every model family.

Asynchronous RL (docs/concepts.md#importance-weights-when-the-sampler-is-not-the-policy)
weights each token by the trainer's probability over the sampler's. jaxrlhf computes both
from one model definition, so on the same parameters they must agree: the log-probs a
sampler returns with its tokens (`SampleOutput.logprobs`, of the untruncated
softmax(logits/τ), whatever top-p drew from) equal the trainer's recomputation of the
same tokens (`experience.score_responses`, GRPO's scoring: each prompt run once for its G
samples, log-probs through the fused LM head, `ops.linear_logprobs`).

Checked for Llama 3, Qwen2, Qwen3, Mistral and Gemma 1/2/3 (the tiny random Hugging Face
checkpoints of tests/models/conftest.py loaded with `load_pretrained`), for the static
sampler (`generate`; on a CPU as two concurrent row blocks, what it does there by default
on two or more cores) and the continuous one (`generate_continuous`, slots refilled as
rows end):

- float32 params and cache: max |Δ| ≤ 1e-5 over the valid response tokens;
- bfloat16 params and cache: `ops.importance_weights(...)["mismatch_kl"]` ≤ 1e-3, a bound
  fixed before anything was measured.

Every family runs the default configuration (unrolled stack, τ = 1, no top-p, no
adapters) in float32 and in bfloat16; the quick tier runs Llama 3 and Gemma 3 in float32
and Gemma 3 (the largest measured bf16 gap) in bfloat16, the heavy one (CI) the rest. The other axes — a scanned stack, LoRA adapters
with B ≠ 0, τ = 0.7 with top-p 0.9, the plain LM head with ungrouped scoring — run on
one or two families, one case of them quick. `benchmarks/parity_gate.py` prints what
`measure` finds for every family (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import ops
from jaxrlhf.algorithms.experience import score_responses
from jaxrlhf.models import Transformer, load_pretrained, lora
from jaxrlhf.rollout import SampleOutput, generate, generate_continuous

from tests.models.conftest import PAD, VOCAB, build_hf, torch

FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3")
QUICK_FLOAT32 = ("llama3", "gemma3")  # the quick tier's float32 families (the others: heavy, in CI)
FLOAT32_MAX_ABS = 1e-5  # max |Δ log p| over valid tokens, float32 params and cache
BFLOAT16_MISMATCH_KL = 1e-3  # `mismatch_kl` (k3 estimate of KL(sampler ‖ trainer)), bfloat16; fixed in advance

PROMPT_LENGTHS = (7, 3)  # two left-padded prompts, P = 7 > the sliding window (5)
G = 2  # samples per prompt: N = 4 rows, scored as GRPO scores them (each prompt once)
T = 10  # response tokens at most: P + T crosses the window again while decoding
SLOTS = 3  # the continuous sampler's slots, fewer than N: a slot is refilled when its row ends
STOP_IDS = tuple(range(2, 17))  # 15 of 300 ids end a response: rows end at different steps
KEY = 3


class Checkpoints:
    """Each family's tiny random checkpoint (tests/models/conftest.py's `build_hf`), saved
    once under `root`, seeded by the family's place in `FAMILIES` (the model tests' store
    seeds by build order): a test or benchmark run of some families sees the checkpoints
    of a run of all of them."""

    def __init__(self, root: Path):
        self.root, self.paths = root, {}

    def path(self, family: str) -> str:
        if family not in self.paths:
            folder = self.root / family
            build_hf(family, seed=FAMILIES.index(family)).save_pretrained(folder, safe_serialization=True)
            self.paths[family] = str(folder)
        return self.paths[family]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    torch.set_num_threads(1)
    return Checkpoints(tmp_path_factory.mktemp("hf"))


def prompts(lengths=PROMPT_LENGTHS, width=PROMPT_LENGTHS[0], seed=0):
    """`[B, P]` random ids in [3, V), left-padded, and their bool mask."""
    rng = np.random.default_rng(seed)
    ids_BxP = rng.integers(3, VOCAB, (len(lengths), width)).astype(np.int32)
    mask_BxP = np.arange(width)[None] >= width - np.asarray(lengths)[:, None]
    return np.where(mask_BxP, ids_BxP, PAD), mask_BxP


def with_moved_adapters(model: Transformer, params, seed: int = 5):
    """`model` with rank-4 adapters on every projection (the LM head too where it is not
    tied) and `params` with them added, every B drawn N(0, 0.05): adapters that change the
    model (fresh ones have B = 0 and change nothing)."""
    c = model.config
    targets = lora.DEFAULT_TARGETS + (() if c.tie_word_embeddings else (lora.LM_HEAD,))
    model = Transformer(c.replace(lora=lora.LoraConfig(rank=4, targets=targets)))
    params = lora.add_adapters(model, params, jax.random.key(1))
    rng = np.random.default_rng(seed)
    moved = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype) if path[-1].key == "lora_b" else x,
        lora.adapters(params))
    return model, lora.with_trainable(params, moved)


def load(path: str, dtype: str, *, scan: bool = False, head: str = "chunked", adapters: bool = False):
    """`(model, params)` of a checkpoint folder with params, compute and cache in `dtype`."""
    model, params = load_pretrained(path, param_dtype=dtype, scan_layers=scan, logprobs_head=head)
    return with_moved_adapters(model, params) if adapters else (model, params)


@functools.lru_cache(maxsize=None)
def _scorer(model: Transformer, prompt_len: int, group_size: int):
    """`score_responses` jitted, τ traced (one program for every temperature)."""
    return jax.jit(lambda params, seq, mask, tau: score_responses(model, params, seq, mask, prompt_len,
                                                                  temperature=tau, group_size=group_size))


@dataclasses.dataclass(frozen=True)
class Gap:
    """One sampler's log-probs against the trainer's, over the valid response tokens."""

    max_abs: float  # max |trainer − sampler|
    mismatch_kl: float  # `ops.importance_weights(trainer, sampler, mask, mode="none")`'s
    tokens: int  # valid response tokens
    mean_logp: float  # the sampler's mean log-prob of them (a sanity figure: far below 0)


def sample_both(model: Transformer, params, *, temperature: float = 1.0, top_p: float = 1.0
                ) -> dict[str, SampleOutput]:
    """`{sampler: SampleOutput}`: `B·G` responses to `prompts()` drawn with (τ, top-p) by the
    static sampler (`generate`; on a CPU as two row blocks, what it does by default on 2 or
    more cores, fixed so that the case does not depend on the machine) and the continuous
    one (`generate_continuous`, `SLOTS` slots)."""
    ids_BxP, mask_BxP = prompts()
    kw = dict(max_new_tokens=T, temperature=temperature, top_p=top_p, eos_id=STOP_IDS, num_samples=G)
    key = jax.random.key(KEY)
    return {"static": generate(model, params, ids_BxP, mask_BxP, key, cpu_threads=2, **kw),
            "continuous": generate_continuous(model, params, ids_BxP, mask_BxP, key, slots=SLOTS, **kw)}


def gaps(model: Transformer, params, outs: dict[str, SampleOutput], *, temperature: float = 1.0,
         group_size: int = G) -> dict[str, Gap]:
    """`{sampler: Gap}`: each sampler's log-probs against the trainer's of the same tokens
    (`score_responses` at `temperature`, rows in groups of `group_size`: G is GRPO's
    shared-prompt scoring, 1 one forward pass per row)."""
    score = _scorer(model, PROMPT_LENGTHS[0], group_size)
    out_gaps = {}
    for name, out in outs.items():
        trainer_NxT = score(params, out.sequences, out.attention_mask, jnp.float32(temperature))
        sampler_NxT = np.asarray(out.logprobs)
        valid_NxT = np.asarray(out.response_mask)
        assert not sampler_NxT[~valid_NxT].any(), f"{name}: log-probs on padding"
        kl = ops.importance_weights(trainer_NxT, sampler_NxT, valid_NxT, mode="none")[1]["mismatch_kl"]
        diff_V = np.abs(np.asarray(trainer_NxT) - sampler_NxT)[valid_NxT]
        out_gaps[name] = Gap(float(diff_V.max()), float(kl), int(valid_NxT.sum()),
                             float(sampler_NxT[valid_NxT].mean()))
    return out_gaps


def measure(model: Transformer, params, *, temperature: float = 1.0, top_p: float = 1.0,
            group_size: int = G) -> dict[str, Gap]:
    """`gaps` of both samplers' responses, scored at the sampling temperature."""
    return gaps(model, params, sample_both(model, params, temperature=temperature, top_p=top_p),
                temperature=temperature, group_size=group_size)


def _check_sane(found: dict[str, Gap]) -> None:
    """Enough valid tokens with real log-probs that a gap could show (random 300-token
    models: log-probs near −log 300 ≈ −5.7)."""
    for name, gap in found.items():
        assert gap.tokens >= 8 and gap.mean_logp < -1.0, (name, gap)


def _check_float32(found: dict[str, Gap]) -> None:
    _check_sane(found)
    assert all(g.max_abs <= FLOAT32_MAX_ABS for g in found.values()), found


def _check_bfloat16(found: dict[str, Gap]) -> None:
    _check_sane(found)
    assert all(g.mismatch_kl <= BFLOAT16_MISMATCH_KL for g in found.values()), found


def _check_fails_by_far(found: dict[str, Gap]) -> None:
    """A deliberately wrong trainer (another τ, the adapters dropped) fails both gates, the
    bf16 one ten times over: the gates can fail."""
    assert all(g.max_abs > 1e3 * FLOAT32_MAX_ABS and g.mismatch_kl > 10 * BFLOAT16_MISMATCH_KL
               for g in found.values()), found


@pytest.mark.parametrize("family", [f if f in QUICK_FLOAT32 else pytest.param(f, marks=pytest.mark.heavy)
                                    for f in FAMILIES])
def test_float32_sampler_logprobs_equal_the_trainers(store, family):
    """float32: both samplers' log-probs equal GRPO's scoring (fused head, prompts run once
    per group) to 1e-5 on every family — attention over a left-padded prompt longer than
    the sliding window, soft caps, q/k norms, scaled embeddings, tied and untied heads."""
    _check_float32(measure(*load(store.path(family), "float32")))


@pytest.mark.parametrize("family", [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.heavy)
                                    for f in FAMILIES])
def test_bfloat16_sampler_logprobs_match_the_trainers(store, family):
    """bfloat16 params and cache: a decode step and the trainer's T-token pass round
    differently, so the gate is the mismatch KL an importance-weighted loss would see:
    ≤ 1e-3 on every family (Gemma 3, the largest measured gap, in the quick tier)."""
    _check_bfloat16(measure(*load(store.path(family), "bfloat16")))


def test_bfloat16_row_blocks_sample_what_one_program_samples(store):
    """bfloat16 on a CPU: `generate`'s two row blocks (one prompt each) return the tokens
    and log-probs of one program over both prompts, bit for bit. Before the dense
    attention took its scores from a float32-accumulating dot, XLA kept or dropped their
    bf16 rounding by program shape (`xla_allow_excess_precision`): the blocks drew other
    tokens, and their log-probs missed the trainer's by up to 4e-2 here (docs/benchmarks.md)."""
    model, params = load(store.path("gemma3"), "bfloat16")
    ids_BxP, mask_BxP = prompts()
    kw = dict(max_new_tokens=T, eos_id=STOP_IDS, num_samples=G)
    blocks = generate(model, params, ids_BxP, mask_BxP, jax.random.key(KEY), cpu_threads=2, **kw)
    one = generate(model, params, ids_BxP, mask_BxP, jax.random.key(KEY), cpu_threads=1, **kw)
    for name, a, b in zip(SampleOutput._fields, blocks, one):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _case(family, dtype, *, heavy=True, scan=False, adapters=False, head="chunked", temperature=1.0, top_p=1.0,
          group_size=G):
    """A `test_other_axes` parameter named after what differs from the default case."""
    parts = [family, dtype, "scanned" if scan else "", "lora" if adapters else "", head if head != "chunked" else "",
             f"t{temperature:g}" if temperature != 1.0 else "", f"p{top_p:g}" if top_p != 1.0 else "",
             "ungrouped" if group_size != G else ""]
    args = (family, dtype, dict(scan=scan, adapters=adapters, head=head),
            dict(temperature=temperature, top_p=top_p, group_size=group_size))
    return pytest.param(*args, id="-".join(p for p in parts if p), marks=[pytest.mark.heavy] if heavy else [])


AXES = [
    # The quick tier's one case: a scanned stack with adapters, sampled at τ = 0.7 with top-p 0.9.
    _case("llama3", "float32", heavy=False, scan=True, adapters=True, temperature=0.7, top_p=0.9),
    _case("gemma3", "float32", scan=True),  # local and global layers under `lax.cond`
    _case("gemma2", "bfloat16", adapters=True),  # float32 adapters on a bf16 base, on the projections only (tied head)
    _case("mistral", "float32", head="plain", group_size=1),  # the trainer's other path
]


@pytest.mark.parametrize("family, dtype, model_kw, kw", AXES)
def test_other_axes(store, family, dtype, model_kw, kw):
    """The gate under the other axes, on one or two families each:

    - τ ≠ 1 with top-p < 1: the sampler draws from the nucleus but returns the log-probs of
      the whole softmax(logits/τ), the density the trainer computes; the same tokens scored
      at τ = 1 fail the gate by far (it can fail);
    - `scan_layers=True`: one `lax.scan` over the stack, the samplers' caches stacked;
    - rank-4 LoRA adapters with B ≠ 0 on every projection (and an untied LM head, folded
      into the fused head's weight): with B = 0 (the base model) the trainer's log-probs of
      the same tokens fail the gate by far (the adapters matter);
    - the plain LM head (`[B, T, V]` logits, `ops.token_logprobs`) with each row scored by
      its own forward pass (no shared prompt).
    """
    model, params = load(store.path(family), dtype, **model_kw)
    tau, group_size = kw["temperature"], kw["group_size"]
    outs = sample_both(model, params, temperature=tau, top_p=kw["top_p"])
    found = gaps(model, params, outs, temperature=tau, group_size=group_size)
    (_check_float32 if dtype == "float32" else _check_bfloat16)(found)
    if tau != 1.0:
        _check_fails_by_far(gaps(model, params, outs, temperature=1.0, group_size=group_size))
    if model_kw["adapters"]:  # the same params with every B = 0: the base model, the same programs
        zero_b = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.zeros_like(x) if path[-1].key == "lora_b" else x, lora.adapters(params))
        _check_fails_by_far(gaps(model, lora.with_trainable(params, zero_b), outs, temperature=tau,
                                 group_size=group_size))
