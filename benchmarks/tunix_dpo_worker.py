"""bench_dpo.py's DPO step with Google's Tunix (`tunix.sft.dpo.DPOTrainer`).

Run by `bench_dpo.py --tunix-python PY` in a separate environment that has `google-tunix`
(see benchmarks/README.md); standalone:

    /tmp/venv_tunix/bin/python benchmarks/tunix_dpo_worker.py --warmup 3 --steps 8 [--ckpt HF_DIR] \
        [--ref per-step|precomputed]

Prints one JSON line: the seconds of each optimizer step after warm-up, peak RSS (as
tunix_grpo_worker.py: `peak_rss_mib` = `ru_maxrss`, `vm_hwm_mib` = the process's own peak),
and the settings actually used.

Model: Tunix's own `Llama3` at the workload's sizes in float32 (built as in
tunix_grpo_worker.py, including its RoPE θ fix: Tunix 0.1.7 ignores `ModelConfig.rope_theta`
and uses 1e6; here 10000, `--tunix-rope` keeps 1e6), with the weights of `--ckpt` (the HF
checkpoint bench_dpo.py saves for every side, read by Tunix's safetensors loader) or Tunix's
random init without it. The reference model is a second copy loaded from the same weights.
Both live on a 1x1 ("fsdp", "tp") CPU mesh and the trainer runs inside it, as RLCluster
sets up its trainers (without a mesh the jitted train step compiled a second time on step 2,
uncommitted initial arrays vs committed ones).

Data: `bench_dpo.make_data` (16 pairs; prompts = rows 0-15 of the workload prompts, 32
tokens; chosen / rejected = 63 random tokens + EOS, 64 tokens; no padding), fed as Tunix's
tokenized `TrainingInput` fields (all masks 1), the same batch every step, as the other sides.

Loss and optimizer as bench_dpo.py: `DPOTrainingConfig(algorithm="dpo", beta=0.1,
label_smoothing=0)` (sigmoid loss on summed response log-probs, policy minus reference),
`optax.adamw(1e-5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0)`, constant learning rate, no
gradient clipping, no gradient accumulation; the chosen and rejected rows go through one
forward of 32 rows x 96 tokens, as in Tunix.

`--ref` (the main setting where Tunix differs from the other sides; the other is RoPE θ):
  per-step     Tunix's DPOTrainer as shipped: it has no option to precompute reference
               log-probs, and `_prepare_inputs` runs the reference model forward on every
               step (an extra 32 x 96 forward per step that jaxrlhf and TRL, with
               precompute_ref_log_probs=True, do not time).
  precomputed  the same DPOTrainer, with the reference log-probs computed once, before
               training, by DPOTrainer's own `_prepare_inputs` on the (fixed) batch, and
               then reused every step (a subclass overrides `_prepare_inputs`; the loss,
               train step and optimizer are Tunix's). This is the work the other sides time.

Timing: step `i` = the wall time between fetches of batch `i` and `i + 1` by
`PeftTrainer.train`, each taken after the policy parameters of the previous step are
ready, so one step = Tunix's per-step input preparation (concatenation, masks, positions,
the reference forward in per-step mode) + the jitted train step + its metric buffering. The
first `--warmup` steps (compile) are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from bench_dpo import BETA, LR, B, P, T, make_data  # noqa: E402
from tunix_grpo_worker import flat_params, peak_rss, probe_logits, tunix_llama  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--ckpt", default=None, help="HF safetensors dir with the workload's weights (default: Tunix init)")
    ap.add_argument("--ref", choices=("per-step", "precomputed"), default="per-step")
    ap.add_argument("--tunix-rope", action="store_true",
                    help="keep Tunix 0.1.7's RoPE theta 1e6 (its Llama3 ignores ModelConfig.rope_theta)")
    args = ap.parse_args()
    total = args.warmup + args.steps

    import jax
    import optax
    import tunix
    from flax import nnx
    from tunix.sft.dpo import dpo_trainer

    t_setup = time.perf_counter()
    d = make_data(_common.load_workload(args.prompts))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model, _, model_settings = tunix_llama(args.ckpt, mesh=mesh, tunix_rope=args.tunix_rope)
    ref_model, _, _ = tunix_llama(args.ckpt, mesh=mesh, tunix_rope=args.tunix_rope)
    probe = probe_logits(model, d["prompt_ids"][0])
    before = {k: np.array(v) for k, v in flat_params(model).items()}
    batch = dict(prompt_ids=d["prompt_ids"], prompt_mask=np.ones((B, P), np.int32),
                 chosen_ids=d["chosen_ids"], chosen_mask=np.ones((B, T), np.int32),
                 rejected_ids=d["rejected_ids"], rejected_mask=np.ones((B, T), np.int32))

    class PrecomputedRefDPOTrainer(dpo_trainer.DPOTrainer):
        """DPOTrainer whose reference log-probs come from one earlier call of its own `_prepare_inputs`."""

        ref_logps = None

        def precompute_reference(self, example):
            ex = super()._prepare_inputs(example)
            jax.block_until_ready((ex.ref_chosen_logps, ex.ref_rejected_logps))
            self.ref_logps = (ex.ref_chosen_logps, ex.ref_rejected_logps)
            self._ref_model_exists = False  # from now on _prepare_inputs skips the reference forward
            self.ref_model = None

        def _prepare_inputs(self, example):
            ex = super()._prepare_inputs(example)
            if self.ref_logps is not None:
                ex = ex.replace(ref_chosen_logps=self.ref_logps[0], ref_rejected_logps=self.ref_logps[1])
            return ex

    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    config = dpo_trainer.DPOTrainingConfig(algorithm="dpo", beta=BETA, label_smoothing=0.0,
                                           eval_every_n_steps=10**9, max_steps=total, pbar_description=None)
    cls = PrecomputedRefDPOTrainer if args.ref == "precomputed" else dpo_trainer.DPOTrainer
    with mesh:
        trainer = cls(model=model, ref_model=ref_model, optimizer=tx, training_config=config)
        ref_s = None
        if args.ref == "precomputed":
            t0 = time.perf_counter()
            trainer.precompute_reference(dict(batch))
            ref_s = time.perf_counter() - t0
            del ref_model
    setup_s = time.perf_counter() - t_setup

    fetch_times = []

    def batches():
        while True:  # PeftTrainer stops after max_steps optimizer steps; it fetches once more first
            if fetch_times:
                jax.block_until_ready(jax.tree.leaves(nnx.state(trainer.model, nnx.Param)))
            fetch_times.append(time.perf_counter())
            yield dict(batch)

    losses = []
    orig_buffer = trainer._buffer_metrics  # noqa: SLF001 - the loss of each step, for the first/last loss

    def buffer_metrics(metrics_buffer, loss, step, additional_metrics=None):
        losses.append(loss)
        return orig_buffer(metrics_buffer, loss, step, additional_metrics)

    trainer._buffer_metrics = buffer_metrics  # noqa: SLF001
    with _common.CpuWatch() as watch, mesh:
        trainer.train(batches())
    assert trainer.train_steps == total and len(fetch_times) == total + 1, (trainer.train_steps, len(fetch_times))
    all_steps = np.diff(fetch_times).tolist()
    losses = [float(x) for x in losses]
    after = flat_params(trainer.model)
    changed = {k: float(np.max(np.abs(np.asarray(after[k]) - before[k]))) for k in before}

    print(json.dumps({
        "impl": "tunix", "ref": args.ref, "warmup": args.warmup, "steps": args.steps,
        "step_times": all_steps[args.warmup:], "warmup_step_times": all_steps[:args.warmup],
        "first_call_s": all_steps[0], "setup_s": setup_s, "ref_precompute_s": ref_s,
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
        **peak_rss(),
        "cpu_watch": watch.result(detail=True), "probe_logits": probe,
        "checks": {"optimizer_steps": trainer.train_steps, "params_changed": sum(v > 0 for v in changed.values()),
                   "params_total": len(changed), "max_abs_param_change": max(changed.values())},
        "settings": {
            **model_settings, "pairs": B, "prompt_len": P, "response_len": T, "algorithm": "dpo",
            "loss": "sigmoid", "beta": BETA, "label_smoothing": 0.0,
            "reference_logps": "reference model forward every step (DPOTrainer as shipped)"
            if args.ref == "per-step" else "computed once before training by DPOTrainer._prepare_inputs, reused",
            "optimizer": f"optax.adamw({LR}, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0), constant lr, no clipping",
            "mesh": "1x1 ('fsdp', 'tp') on " + jax.devices()[0].platform,
            "tunix": tunix.__version__, "jax": jax.__version__, "optax": optax.__version__,
        },
        "differences": (["reference log-probs recomputed every step (Tunix's DPOTrainer has no precompute option); "
                         "jaxrlhf and TRL precompute them once"] if args.ref == "per-step" else
                        ["reference log-probs precomputed by a DPOTrainer subclass (Tunix has no option for it)"])
                       + (["RoPE theta: Tunix's apply_rope default patched to 10000 (Tunix 0.1.7 ignores "
                           "ModelConfig.rope_theta)"] if not args.tunix_rope else
                          ["RoPE theta 1e6 (Tunix 0.1.7 ignores ModelConfig.rope_theta), not 10000"]),
        "timing": "step i = fetch of batch i -> fetch of batch i+1 by PeftTrainer.train, each fetch after the "
                  "previous step's parameters are ready",
    }))


if __name__ == "__main__":
    main()
