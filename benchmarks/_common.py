"""What every benchmark on the reference workload (docs/benchmarks.md#the-reference-workload) shares.

The tiny Llama of the workload for both frameworks, the prompt/train-batch token ids,
a min/median/max timer, peak RSS, and a CPU watch that records how much CPU *other*
processes used while a measurement ran (a contended result is not a valid figure).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Every benchmark process (ours, the peers', the Tunix workers' in their own environment)
# runs with the same allocator settings, applied before any framework allocates: glibc
# keeps freed memory for reuse (jaxrlhf/host_allocator.py, stdlib only; opt-in for users).
# JAXRLHF_HOST_ALLOCATOR=default measures without it.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
from jaxrlhf.host_allocator import ENV_VAR, tune_host_allocator  # noqa: E402

HOST_ALLOCATOR_TUNED = tune_host_allocator(os.environ.get(ENV_VAR, "reuse"))
# The workload's prompt and train-batch token ids (keys `prompts`, `train_batch`), beside this file.
WORKLOAD_PROMPTS = Path(__file__).resolve().parent / "workload_prompts.json"

# The reference workload's model table (docs/benchmarks.md#the-reference-workload).
LLAMA = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=10000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# A real checkpoint's shapes over the workload's (SmolLM2-135M-Instruct's config.json), for the
# benchmarks' `--shape smollm2`; a random init of them times what the checkpoint would.
SHAPES = {"workload": {}, "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                          head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                                          rms_norm_eps=1e-5, max_position_embeddings=8192)}


def load_workload(path: str | None = None) -> dict:
    """`{"prompts": [[...]], "train_batch": [[...]]}` token ids from `path`, by default
    benchmarks/workload_prompts.json (`WORKLOAD_PROMPTS`)."""
    p = Path(path) if path else WORKLOAD_PROMPTS
    if not p.exists():
        raise FileNotFoundError(f"workload_prompts.json not found at {p}; pass --prompts")
    return json.loads(p.read_text())


def token_fraction_reward(target: int, name: str):
    """The GRPO benchmarks' JAX reward: the fraction of a completion's valid tokens equal to
    `target` (`jaxrlhf.rewards.jax_reward`)."""
    import jax.numpy as jnp

    from jaxrlhf import rewards

    def fraction_of_target(ids_NxT, mask_NxT, extras):
        mask_NxT = mask_NxT.astype(bool)
        hits = jnp.sum((ids_NxT == target) & mask_NxT, axis=1)
        return (hits / jnp.maximum(jnp.sum(mask_NxT, axis=1), 1)).astype(jnp.float32)

    return rewards.jax_reward(fraction_of_target, name=name)


def hf_llama_config(shape: str = "workload", **extra):
    """The workload's `transformers.LlamaConfig`, with `SHAPES[shape]`'s sizes; `extra` (e.g.
    `attn_implementation`, or a field such as `num_hidden_layers` to override) goes to its
    constructor."""
    import transformers

    return transformers.LlamaConfig(**{**LLAMA, **SHAPES[shape], **extra})


def jax_llama_config(**overrides):
    from jaxrlhf.models import from_hf_config

    return from_hf_config(hf_llama_config(), **overrides)


def hf_llama(seed: int = 0, cls_name: str = "LlamaForCausalLM", shape: str = "workload", **extra):
    """The workload's torch model (`SHAPES[shape]`'s sizes): HF default init after `torch.manual_seed(seed)`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = hf_llama_config(shape)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return getattr(transformers, cls_name)(cfg).eval()


def word_tokenizer(padding_side: str = "right", vocab_size: int = 512):
    """The reference workload's tokenizer for the trainers that want text: word level,
    `"t17 t300"` <-> `[17, 300]`, ids 0..3 are `<pad> <bos> <eos> <unk>`, no special tokens
    added; `vocab_size` ids in all (a larger model's vocabulary: every id it can sample decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side=padding_side)


def summary(times, count_key: str = "runs") -> dict:
    """min/median/max of wall seconds measured elsewhere, and how many there are (under `count_key`)."""
    times = [float(t) for t in times]
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times), count_key: len(times)}


def timed(fn, *, warmup: int, repeats: int, keep_times: bool = False) -> dict:
    """Wall seconds of `fn()` (which must block until its work is done): min/median/max.

    `keep_times=True` adds the individual timed runs under "times".
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    out = summary(times)
    if keep_times:
        out["times"] = times
    return out


@contextlib.contextmanager
def sampler_options(options):
    """Inside the block, `rollout.generate` compiles its programs with these XLA `options`
    (`(name, value)` pairs) instead of what `models.decode_compiler_options` picks: one
    benchmark arm's compile options."""
    from jaxrlhf.rollout import sampler

    real = sampler._compiled
    sampler._compiled = lambda model, _options=(), **static: real(model, tuple(options), **static)
    try:
        yield
    finally:
        sampler._compiled = real


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_ticks():
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))  # minus idle, iowait
    with open(f"/proc/{os.getpid()}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    own = int(parts[11]) + int(parts[12]) + int(parts[13]) + int(parts[14])  # utime stime cutime cstime
    return busy, own, time.monotonic()


class CpuWatch:
    """`with CpuWatch() as w: ...` then `w.result()`: cores used by other processes meanwhile."""

    def __enter__(self):
        self._load0 = os.getloadavg()
        self._start = _cpu_ticks()
        return self

    def __exit__(self, *exc):
        self._end = _cpu_ticks()
        self._load1 = os.getloadavg()

    def result(self, threshold_cores: float = 0.25, detail: bool = False) -> dict:
        """`detail=True` adds this process's cores, the load average before/after and the wall seconds."""
        hz = os.sysconf("SC_CLK_TCK")
        (b0, o0, t0), (b1, o1, t1) = self._start, self._end
        wall = max(t1 - t0, 1e-9)
        others = max((b1 - b0) - (o1 - o0), 0) / hz / wall
        out = {"others_cores": round(others, 3)}
        if detail:
            out.update(own_cores=round((o1 - o0) / hz / wall, 3), loadavg_before=self._load0,
                       loadavg_after=self._load1, wall_s=round(wall, 2))
        out["contended"] = others > threshold_cores
        return out


def write_json(out: str | None, default_name: str, payload: dict) -> Path:
    path = Path(out) if out else REPO / "benchmarks" / "results" / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path


def run_json_worker(cmd: list[str], label: str) -> tuple[dict, "CpuWatch"]:
    """Runs a benchmark worker (another interpreter) inside a `CpuWatch`; returns the last
    JSON line it printed and the watch. Raises RuntimeError with the tail of its stderr."""
    import subprocess
    import sys

    with CpuWatch() as watch:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"[{label}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1]), watch


def tunix_row(w: dict, watch: "CpuWatch", probe) -> dict:
    """The fields every Tunix training row records, from a worker's JSON `w`: its own peak
    RSS (VmHWM; `ru_maxrss` of a subprocess also counts the parent's peak at spawn), CPU
    watches, the logit check against the torch model (`probe`), checks and settings."""
    import numpy as np

    return dict(peak_rss_mib=w["vm_hwm_mib"], ru_maxrss_mib=w["peak_rss_mib"], peak_rss_note=w["peak_rss_note"],
                cpu_watch=w["cpu_watch"], cpu_watch_subprocess=watch.result(detail=True),
                same_model_max_abs_logit_diff=float(np.max(np.abs(np.asarray(w["probe_logits"]) - probe))),
                checks=w["checks"], settings=w["settings"], differences=w["differences"])

