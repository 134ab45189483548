"""Training-step memory at real sequence lengths, planned ahead of time (no weights needed).

Each row compiles a step with `jax.jit(f).lower(*abstract).compile()` on `jax.eval_shape`
params and reads XLA's plan, `memory_analysis().temp_size_in_bytes` (temporaries; the
arguments — params, optimizer state, batch — are listed apart). "dense" is the model as
it was before the long-sequence work (`attention="dense"` and, where the option exists,
the plain LM head); "default" is what a user gets (`"auto"` everywhere).

Parts:
  table  SmolLM2-135M-shaped model cut to 4 layers, B = 1, P = 64: `jax.grad` of the summed
         `algorithms.common.response_logprobs` (the path every trainer takes).
  grpo   Qwen2.5-0.5B-shaped (896 wide, 24 layers, 14/2 heads, V = 151,936), B = 8, P = 256:
         `grpo.update` with β > 0 (reference log-probs in the batch), token-mean loss.
  ppo    the same model as actor and as a separate critic, `ppo.update` (one epoch, one
         minibatch), the four-model PPO's training step.
  8b     Llama-3-8B-shaped PPO step (actor and critic trained with AdamW, float32 master
         weights; reference and reward model frozen in bf16; bf16 compute) on an 8-device
         fsdp mesh of XLA:CPU devices: the per-device plan for 8 accelerators, with the
         scanned, rematerialised stack (the setting for that size).

  lora   full fine-tuning against LoRA rank 16 (`models.lora`, and "qlora": the same on an
         NF4 base, `models.quant`) for the GRPO and PPO steps
         of a Qwen2.5-0.5B shape (one device, B = 8, P = 256) and of a Llama-3-8B shape
         (`fsdp=8`, B = 8, P = 512), bf16 compute, scanned and rematerialised stacks.
         Full: float32 master weights + AdamW for each trained role (PPO: actor and a
         separate critic), the reference (and PPO's reward model) a separate bf16 copy.
         LoRA: one base frozen in bf16; the actor's adapters, and PPO's critic and reward
         model as adapters + score head on that base (`lora.is_part`), float32 with their
         AdamW moments; the reference is the base without the adapters. Per device: args
         (params, optimizer state, frozen models, batch) + temp, and the base's bf16
         weights for scale.

Variants: "dense" (before), "default" (`auto` everywhere) and "scan+remat" (the default
plus `scan_layers=True, remat="full"`).

XLA:CPU's schedule does not honour rematerialisation, so figures with remat are upper
bounds on an accelerator's.

    python benchmarks/bench_memory.py --part table
    python benchmarks/bench_memory.py --part grpo --lengths 1024,2048,4096,8192,16384
    python benchmarks/bench_memory.py --part 8b     # sets 8 host devices itself
    python benchmarks/bench_memory.py --part lora   # sets 8 host devices itself
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--part" in sys.argv and sys.argv[sys.argv.index("--part") + 1] in ("8b", "lora"):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxrlhf.algorithms import common, grpo, ppo  # noqa: E402
from jaxrlhf.algorithms.experience import SamplingConfig  # noqa: E402
from jaxrlhf.models import ModelConfig, Transformer, lora  # noqa: E402
from jaxrlhf.models.config import RUNTIME_FIELDS  # noqa: E402

MiB = 2**20
SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
            tie_word_embeddings=True, max_position_embeddings=65536)
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                num_kv_heads=2, head_dim=64, tie_word_embeddings=True, qkv_bias=True, model_type="qwen2",
                max_position_embeddings=65536)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=131072)
# The model before the long-sequence work; options this version lacks are left out.
DENSE = {k: v for k, v in dict(attention="dense", logprobs_head="plain").items() if k in RUNTIME_FIELDS}
# What a user at real lengths turns on besides the defaults: the scanned stack with each
# layer rematerialised (in a scan the saved residuals are what the policy says, so XLA:CPU's
# plan shows remat's effect there; unrolled, its schedule ignores remat).
SCAN_REMAT = dict(scan_layers=True, remat="full") if "scan_layers" in RUNTIME_FIELDS else None
VARIANTS = [("dense", DENSE), ("default", {})] + ([("scan+remat", SCAN_REMAT)] if SCAN_REMAT else [])


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def abstract_params(model: Transformer, dtype=None):
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"])
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params,
                          is_leaf=lambda x: hasattr(x, "value"))
    if dtype is not None:
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)
    return params


def plan(fn, *args) -> dict:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    m = compiled.memory_analysis()
    return dict(temp_mib=round(m.temp_size_in_bytes / MiB, 1), args_mib=round(m.argument_size_in_bytes / MiB, 1),
                compile_s=round(time.perf_counter() - t0, 1))


def seq(b, length, dtype=jnp.int32):
    return jax.ShapeDtypeStruct((b, length), dtype)


def part_table(lengths, layers=4, b=1, p=64):
    rows = []
    for t in lengths:
        for name, opts in VARIANTS:
            model = Transformer(ModelConfig(num_layers=layers, **SMOL, **opts))
            params = abstract_params(model)

            def loss(params, ids, mask):
                logp, _, _ = common.response_logprobs(model, params, ids, mask, p)
                return jnp.sum(logp)
            rows.append(dict(part="table", T=t, variant=name, **plan(jax.grad(loss), params, seq(b, p + t),
                                                                     seq(b, p + t, jnp.bool_))))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _grpo_inputs(model, b, p, t):
    tx = optax.adamw(1e-6)
    sampling = SamplingConfig(max_new_tokens=t, num_samples=b)
    cfg = grpo.GRPOConfig(sampling=sampling, beta=0.04)
    state = jax.eval_shape(lambda params: grpo.init_state(params, tx), abstract_params(model))
    f32 = lambda: jax.ShapeDtypeStruct((b, t), jnp.float32)
    batch = grpo.Batch(seq(b, p + t), seq(b, p + t, jnp.bool_), seq(b, t, jnp.bool_), f32(), None, f32(), None)
    step = lambda state, batch, rng: grpo.update(state, batch, rng, model=model, tx=tx, cfg=cfg)
    return step, (state, batch, jax.eval_shape(lambda: jax.random.key(0)))


def _by_length(part, lengths, inputs):
    """One row per (T, variant): the plan of the step `inputs(opts, t)` returns."""
    rows = []
    for t in lengths:
        for name, opts in VARIANTS:
            if name == "dense" and t > 8192:
                continue  # its plan passes 2 TiB at 8k already
            step, args = inputs(opts, t)
            rows.append(dict(part=part, T=t, variant=name, **plan(step, *args)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def part_grpo(lengths, b=8, p=256):
    return _by_length("grpo", lengths, lambda opts, t: _grpo_inputs(Transformer(ModelConfig(**QWEN_05B, **opts)),
                                                                   b, p, t))


def _ppo_inputs(shape, opts, b, p, t, *, dtype="float32", frozen_dtype=None):
    actor = Transformer(ModelConfig(**shape, **opts, dtype=dtype), head="lm")
    critic = Transformer(ModelConfig(**shape, **opts, dtype=dtype), head="score")
    tx = optax.adamw(1e-6)
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=t), num_ppo_epochs=1, num_minibatches=1)
    actor_p, critic_p = abstract_params(actor), abstract_params(critic)
    frozen = lambda m: abstract_params(m, frozen_dtype)
    state = jax.eval_shape(
        lambda a, c, r, rm: ppo.init_state(cfg, actor, a, tx, critic_model=critic, critic_params=c, tx_critic=tx,
                                           ref_params=r, reward=critic, reward_params=rm),
        actor_p, critic_p, frozen(actor), frozen(critic))
    f32 = lambda: jax.ShapeDtypeStruct((b, t), jnp.float32)
    batch = ppo.Batch(sequences=seq(b, p + t), attention_mask=seq(b, p + t, jnp.bool_),
                      response_mask=seq(b, t, jnp.bool_), old_logp=f32(), old_values=f32(), advantages=f32(),
                      returns=f32())
    step = lambda state, batch, rng: ppo.update(state, batch, rng, actor_model=actor, critic_model=critic,
                                                tx_actor=tx, tx_critic=tx, cfg=cfg)
    return step, (state, batch, jax.eval_shape(lambda: jax.random.key(0)))


def part_ppo(lengths, b=8, p=256):
    return _by_length("ppo", lengths, lambda opts, t: _ppo_inputs(QWEN_05B, opts, b, p, t))


def part_8b(lengths, b=8, p=512):
    """Per-device plan of the PPO step under `fsdp=8` with the default rules, via `jit_step`."""
    from jaxrlhf import parallel

    mesh = parallel.make_mesh("fsdp=8")
    rows = []
    for t in lengths:
        for name, opts in [(n, o) for n, o in VARIANTS if n != "default"]:
            step, (state, batch, rng) = _ppo_inputs(LLAMA_8B, dict(opts, scan_layers=True, remat="full"), b, p, t,
                                                    dtype="bfloat16",
                                                    frozen_dtype=jnp.bfloat16)
            stacked = ModelConfig(**LLAMA_8B, scan_layers=True)
            actor_sh = parallel.param_shardings(Transformer(stacked, head="lm"), mesh)
            critic_sh = parallel.param_shardings(Transformer(stacked, head="score"), mesh)
            sh = parallel.state_shardings(state, roles={"actor": actor_sh, "critic": critic_sh,
                                                        "ref_params": actor_sh, "reward_params": critic_sh})
            t0 = time.perf_counter()
            compiled = parallel.jit_step(step, mesh=mesh, state_shardings=sh).lower(state, batch, rng).compile()
            m = compiled.memory_analysis()
            rows.append(dict(part="8b", T=t, variant=name, devices=jax.device_count(),
                             temp_mib=round(m.temp_size_in_bytes / MiB, 1),
                             args_mib=round(m.argument_size_in_bytes / MiB, 1),
                             compile_s=round(time.perf_counter() - t0, 1)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


LORA_RANK = 16


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _frozen_bf16(params):
    """`params` with every float leaf but the adapters in bf16 (a QLoRA base's codes stay
    uint8, its scales float32)."""
    def cast(path, x):
        keep = path[-1].key in lora.ADAPTER_KEYS + ("scales",) or not jnp.issubdtype(x.dtype, jnp.floating)
        return x if keep else jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
    return jax.tree_util.tree_map_with_path(cast, params)


def _lora_config(shape, mode) -> ModelConfig:
    """The model of `mode`: "full", "lora" (rank 16) or "qlora" (rank 16 on an NF4 base)."""
    config = ModelConfig(**shape, dtype="bfloat16", scan_layers=True, remat="full")
    if mode != "full":
        config = config.replace(lora=lora.LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK))
    return config.replace(quantize="nf4") if mode == "qlora" else config


def _lora_grpo_inputs(shape, mode, b, p, t):
    """The GRPO step's abstract inputs, full fine-tuning or LoRA (see the module docstring):
    (step, (state, batch, rng), model, base bf16 params)."""
    model = Transformer(_lora_config(shape, mode))
    params = abstract_params(model)
    base = abstract_params(Transformer(_lora_config(shape, "full")), jnp.bfloat16)
    tx = optax.adamw(1e-6)
    cfg = grpo.GRPOConfig(sampling=SamplingConfig(max_new_tokens=t, num_samples=b), beta=0.04)
    if mode != "full":  # base frozen in bf16 (or NF4), adapters float32; the reference is the base
        state = jax.eval_shape(lambda w: grpo.init_state(w, tx), _frozen_bf16(params))
    else:  # float32 master weights, the reference a separate bf16 copy
        state = jax.eval_shape(lambda w, r: grpo.init_state(w, tx, ref_params=r), params, base)
    f32 = lambda: jax.ShapeDtypeStruct((b, t), jnp.float32)
    batch = grpo.Batch(seq(b, p + t), seq(b, p + t, jnp.bool_), seq(b, t, jnp.bool_), f32(), None, f32(), None)
    step = lambda state, batch, rng: grpo.update(state, batch, rng, model=model, tx=tx, cfg=cfg)
    return step, (state, batch, jax.eval_shape(lambda: jax.random.key(0))), model, base


def _lora_ppo_inputs(shape, mode, b, p, t):
    """The PPO step's abstract inputs, full fine-tuning or LoRA (module docstring):
    (step, (state, batch, rng), {role: model}, base bf16 params)."""
    config = _lora_config(shape, mode)
    actor, critic = Transformer(config, head="lm"), Transformer(config, head="score")
    actor_p, critic_p = abstract_params(actor), abstract_params(critic)
    bf16 = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), tree)
    base = abstract_params(Transformer(_lora_config(shape, "full")), jnp.bfloat16)
    tx = optax.adamw(1e-6)
    cfg = ppo.PPOConfig(sampling=SamplingConfig(max_new_tokens=t), num_ppo_epochs=1, num_minibatches=1)
    if mode != "full":  # one bf16 (or NF4) base; the critic and reward model are adapters + score head on it
        part = lora.trainable(critic_p)
        state = jax.eval_shape(
            lambda a, c, rm: ppo.init_state(cfg, actor, a, tx, critic_model=critic, critic_params=c, tx_critic=tx,
                                            reward=(critic, rm)),
            _frozen_bf16(actor_p), part, part)
    else:  # float32 actor and critic trained; reference and reward model frozen bf16 copies
        state = jax.eval_shape(
            lambda a, c, r, rm: ppo.init_state(cfg, actor, a, tx, critic_model=critic, critic_params=c, tx_critic=tx,
                                               ref_params=r, reward=critic, reward_params=rm),
            actor_p, critic_p, base, bf16(critic_p))
    f32 = lambda: jax.ShapeDtypeStruct((b, t), jnp.float32)
    batch = ppo.Batch(sequences=seq(b, p + t), attention_mask=seq(b, p + t, jnp.bool_),
                      response_mask=seq(b, t, jnp.bool_), old_logp=f32(), old_values=f32(), advantages=f32(),
                      returns=f32())
    step = lambda state, batch, rng: ppo.update(state, batch, rng, actor_model=actor, critic_model=critic,
                                                tx_actor=tx, tx_critic=tx, cfg=cfg)
    roles = {"actor": actor, "critic": critic, "ref_params": actor, "reward_params": critic}
    return step, (state, batch, jax.eval_shape(lambda: jax.random.key(0))), roles, base


def part_lora(lengths, rows_per_device=8):
    """Full fine-tuning vs LoRA: per-device args + temp of the GRPO and PPO steps (module
    docstring)."""
    from jaxrlhf import parallel

    rows = []
    for name, shape, p, devices in [("qwen2.5-0.5b", QWEN_05B, 256, 1), ("llama-3-8b", LLAMA_8B, 512, 8)]:
        mesh = parallel.make_mesh("fsdp=8") if devices == 8 else None
        for algorithm in ("grpo", "ppo"):
            for t in lengths:
                for mode in ("full", "lora", "qlora"):
                    if algorithm == "grpo":
                        step, args, model, base = _lora_grpo_inputs(shape, mode, rows_per_device, p, t)
                        roles = {"policy": model, "ref_params": model}
                    else:
                        step, args, roles, base = _lora_ppo_inputs(shape, mode, rows_per_device, p, t)
                    t0 = time.perf_counter()
                    if mesh is None:
                        compiled = jax.jit(step).lower(*args).compile()
                    else:
                        sh = {k: parallel.param_shardings(m, mesh) for k, m in roles.items()}
                        st_sh = parallel.state_shardings(args[0], roles=sh)
                        compiled = parallel.jit_step(step, mesh=mesh, state_shardings=st_sh).lower(*args).compile()
                    m = compiled.memory_analysis()
                    trained = [s.params for s in (getattr(args[0], f, None) for f in ("policy", "actor", "critic"))
                               if s is not None]
                    rows.append(dict(part="lora", model=name, algorithm=algorithm, T=t, variant=mode, devices=devices,
                                     args_mib=round(m.argument_size_in_bytes / MiB, 1),
                                     temp_mib=round(m.temp_size_in_bytes / MiB, 1),
                                     base_bf16_mib=round(_nbytes(base) / devices / MiB, 1),
                                     trained_params=sum(x.size for t in trained for x in jax.tree.leaves(lora.trainable(t))),
                                     compile_s=round(time.perf_counter() - t0, 1)))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


PARTS = {"table": (part_table, "256,512,1024,2048,4096"), "grpo": (part_grpo, "1024,2048,4096,8192,16384"),
         "ppo": (part_ppo, "1024,2048,4096,8192,16384"), "8b": (part_8b, "2048,4096,8192"),
         "lora": (part_lora, "1024")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--lengths", default=None, help="comma-separated response lengths T")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--variants", default=None, help="comma-separated subset of: " + ",".join(n for n, _ in VARIANTS))
    args = ap.parse_args()
    if args.variants:
        keep = args.variants.split(",")
        VARIANTS[:] = [(n, o) for n, o in VARIANTS if n in keep]
    fn, default = PARTS[args.part]
    rows = fn([int(x) for x in (args.lengths or default).split(",")])
    if args.part == "lora":
        print("\n| model | algorithm | T | variant | trained params | args MiB | temp MiB | args + temp | "
              "(args + temp) / (base bf16 + temp) |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            total = r["args_mib"] + r["temp_mib"]
            print(f"| {r['model']} | {r['algorithm']} | {r['T']} | {r['variant']} | {r['trained_params']:,} | "
                  f"{r['args_mib']:,.0f} | {r['temp_mib']:,.0f} | {total:,.0f} | "
                  f"{total / (r['base_bf16_mib'] + r['temp_mib']):.2f} |")
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
        return
    names = [n for n, _ in VARIANTS if any(r["variant"] == n for r in rows)]
    print("\n| T | " + " | ".join(f"{n} temp MiB" for n in names) + " | dense / default | default / previous T |")
    print("|---|" + "---|" * (len(names) + 2))
    prev = None
    for t in sorted({r["T"] for r in rows}):
        temp = {r["variant"]: r["temp_mib"] for r in rows if r["T"] == t}
        cells = [f"{temp[n]:,.0f}" if n in temp else "" for n in names]
        ratio = f"{temp['dense'] / temp['default']:.1f}×" if {"dense", "default"} <= set(temp) else ""
        growth = f"×{temp['default'] / prev:.2f}" if prev and "default" in temp else ""
        print(f"| {t} | " + " | ".join(cells) + f" | {ratio} | {growth} |")
        prev = temp.get("default")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
