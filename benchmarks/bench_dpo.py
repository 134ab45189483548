"""DPO step benchmark: jaxrlhf vs TRL's DPOTrainer (and a hand-written PyTorch step, and Tunix's DPOTrainer).

The reference workload's tiny Llama (docs/benchmarks.md#the-reference-workload: vocab 512,
hidden 256, intermediate 688, 4 layers, 4/2 heads, head_dim 64, float32), random init with
`torch.manual_seed(0)`, saved with `save_pretrained` and read by every side, so all start
from identical weights (the first loss is then ln 2 = 0.6931 everywhere: policy = reference).

Data: 16 pairs; prompts = rows 0-15 of `prompts` in workload_prompts.json (32 tokens), chosen
and rejected = 63 tokens from `numpy.random.default_rng(0)` in [4, 512) plus EOS (64 response
tokens, no padding). DPO sigmoid loss, beta 0.1; reference log-probs precomputed once (not
timed per step); AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0, no clipping,
constant learning rate. One step = forward of chosen + rejected (32 rows of 96 tokens) +
backward + optimizer update.

Each side runs in its own subprocess, so that peak RSS (`ru_maxrss`) is that framework's:
  jax    jaxrlhf.algorithms.dpo, `jax.jit(step, donate_argnums=0)`; compile time = lower+compile
  trl    trl.DPOTrainer(precompute_ref_log_probs=True), seconds between optimizer steps
         (a TrainerCallback), torch.set_num_threads(2), bf16 off
  torch  the same DPO step written by hand in PyTorch (transformers LlamaForCausalLM)

  tunix  with `--tunix-python PY` only: Google's Tunix `tunix.sft.dpo.DPOTrainer` in that
         interpreter's environment (tunix_dpo_worker.py; Tunix's own Llama3 at the workload's
         sizes with these weights, same data, β, sigmoid loss and AdamW), twice:
         "tunix" = DPOTrainer as shipped, which has no way to precompute reference log-probs
         and runs the reference forward every step (more work per step than the other
         sides), and "tunix (ref precomputed)" = the same trainer with the reference log-probs
         computed once by its own code and reused (the work the other sides time). Seconds
         between consecutive batch fetches of its training loop, each after the previous
         step's parameters are ready. The row records `same_model_max_abs_logit_diff` (its
         next-token logits after prompt 0 vs the torch model's), the CPU watch of the whole
         subprocess (`cpu_watch_subprocess`) next to that of its timed steps, and as
         `peak_rss_mib` the worker's VmHWM (its `ru_maxrss`, `ru_maxrss_mib`, also counts
         this parent's peak RSS at spawn time, as for every subprocess here).

    python benchmarks/bench_dpo.py --out /tmp/bench_dpo.json      # warm-up 3, 8 timed steps
    python benchmarks/bench_dpo.py --quick                        # smoke run, not a result
    python benchmarks/bench_dpo.py --tunix-python /tmp/venv_tunix/bin/python   # + the two Tunix rows

Each result records `cpu_watch.others_cores` (CPU used by other processes during the timed
loop); `contended: true` marks a figure that is not valid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (CpuWatch, hf_llama, load_workload, peak_rss_mib, run_json_worker, summary,  # noqa: E402
                     timed, tunix_row, word_tokenizer, write_json)

B, P, T = 16, 32, 64
BETA, LR = 0.1, 1e-5
EOS = 2


def make_data(workload: dict) -> dict[str, np.ndarray]:
    prompts = np.asarray(workload["prompts"][:B], np.int32)
    assert prompts.shape == (B, P), prompts.shape
    rng = np.random.default_rng(0)
    eos = np.full((B, 1), EOS, np.int32)
    chosen = np.concatenate([rng.integers(4, 512, (B, T - 1)).astype(np.int32), eos], axis=1)
    rejected = np.concatenate([rng.integers(4, 512, (B, T - 1)).astype(np.int32), eos], axis=1)
    return dict(prompt_ids=prompts, chosen_ids=chosen, rejected_ids=rejected)


# --------------------------------------------------------------------------- jaxrlhf


def run_jax(ckpt: str, d: dict, warmup: int, repeats: int) -> dict:
    import jax

    from jaxrlhf.algorithms import common, dpo
    from jaxrlhf.models import load_pretrained

    t0 = time.perf_counter()
    model, params = load_pretrained(ckpt)
    pairs = dict(prompt_ids=d["prompt_ids"], prompt_mask=np.ones((B, P), bool),
                 chosen_ids=d["chosen_ids"], chosen_mask=np.ones((B, T), bool),
                 rejected_ids=d["rejected_ids"], rejected_mask=np.ones((B, T), bool))
    t_ref = time.perf_counter()
    pairs = dpo.precompute_reference_logprobs(model, params, pairs, batch_size=B)
    ref_s = time.perf_counter() - t_ref
    batch = {k: jax.device_put(v) for k, v in pairs.items()}
    tx, _ = common.make_optimizer(common.OptimConfig(lr=LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                                     max_grad_norm=None))
    state = dpo.init_state(params, tx)
    rng = jax.random.key(0)
    t_c = time.perf_counter()
    step = dpo.jit_train_step(model, tx, dpo.DPOConfig(beta=BETA)).lower(state, batch, rng).compile()
    compile_s = time.perf_counter() - t_c
    losses, timed_metrics = [], []
    for _ in range(warmup):
        state, m = step(state, batch, rng)
        losses.append(float(m["loss"]))
    box = {"state": state}

    def one():
        box["state"], m = step(box["state"], batch, rng)
        jax.block_until_ready(m["loss"])
        timed_metrics.append(m)

    with CpuWatch() as watch:
        stats = timed(one, warmup=0, repeats=repeats, keep_times=True)
    losses += [float(m["loss"]) for m in timed_metrics]
    times = stats.pop("times")
    return dict(stats=stats, step_times=times, compile_s=compile_s, ref_precompute_s=ref_s,
                setup_s=t_c - t0, first_loss=losses[0], last_loss=losses[-1], peak_rss_mib=peak_rss_mib(),
                cpu_watch=watch.result(), note="jax.jit(make_train_step(...), donate_argnums=0), AOT-compiled")


# --------------------------------------------------------------------------- TRL


def run_trl(ckpt: str, d: dict, warmup: int, repeats: int) -> dict:
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    tokenizer = word_tokenizer()

    def text(ids):
        return " ".join("<eos>" if int(t) == EOS else f"t{int(t)}" for t in ids)

    rows = dict(prompt=[text(p) for p in d["prompt_ids"]],
                chosen=[" " + text(c) for c in d["chosen_ids"]],
                rejected=[" " + text(r) for r in d["rejected_ids"]])
    ids = tokenizer(rows["prompt"][0] + rows["chosen"][0])["input_ids"]
    assert ids == [*d["prompt_ids"][0].tolist(), *d["chosen_ids"][0].tolist()], "tokenizer round trip"
    dataset = datasets.Dataset.from_dict(rows)

    step_ends: list[float] = []
    losses: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not step_ends:
                step_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    total = warmup + repeats
    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.DPOConfig(
            output_dir=out_dir, per_device_train_batch_size=B, gradient_accumulation_steps=1,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=0.0, optim="adamw_torch",
            beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None,
            bf16=False, use_cpu=True, max_steps=total, logging_steps=1, save_strategy="no", report_to="none",
            seed=0, disable_tqdm=True, dataloader_num_workers=0)
        t0 = time.perf_counter()
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[StepTimer()])
        init_s = time.perf_counter() - t0  # includes tokenisation and the reference precompute
        with CpuWatch() as watch:  # brackets all of train(): warm-up steps included
            trainer.train()
    deltas = np.diff(step_ends).tolist()
    timed_steps = deltas[warmup:]
    return dict(stats=summary(timed_steps), step_times=timed_steps, init_s=init_s,
                first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                peak_rss_mib=peak_rss_mib(), cpu_watch=watch.result(), trl_version=trl.__version__,
                torch_version=torch.__version__,
                note="trl.DPOTrainer, precompute_ref_log_probs=True; seconds between consecutive optimizer "
                     "steps (on_step_end), so dataloading/collation and logging are included")


# --------------------------------------------------------------------------- hand-written PyTorch


def run_torch(ckpt: str, d: dict, warmup: int, repeats: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    prompt = torch.as_tensor(d["prompt_ids"], dtype=torch.long)
    responses = torch.cat([torch.as_tensor(d["chosen_ids"]), torch.as_tensor(d["rejected_ids"])]).long()
    seq = torch.cat([prompt.repeat(2, 1), responses], dim=1)  # [2B, P + T], no padding

    def seq_logp(m):
        logits = m(input_ids=seq).logits[:, P - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, seq[:, P:, None])[..., 0].sum(-1)

    with torch.no_grad():
        model.eval()
        ref = seq_logp(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        lp = seq_logp(model)
        z = BETA * ((lp[:B] - ref[:B]) - (lp[B:] - ref[B:]))
        loss = -torch.nn.functional.logsigmoid(z).mean()
        loss.backward()
        opt.step()
        return float(loss)

    for _ in range(warmup):
        losses.append(step())
    with CpuWatch() as watch:
        stats = timed(lambda: losses.append(step()), warmup=0, repeats=repeats, keep_times=True)
    times = stats.pop("times")
    return dict(stats=stats, step_times=times, first_loss=losses[0], last_loss=losses[-1],
                peak_rss_mib=peak_rss_mib(), cpu_watch=watch.result(), torch_version=torch.__version__,
                note="hand-written: one forward of 2B rows, reference precomputed, sigmoid loss, AdamW")


# --------------------------------------------------------------------------- Tunix (another interpreter)


def _run_tunix(python: str, ckpt: str, ref: str, probe, warmup: int, repeats: int, prompts: str | None) -> dict:
    """Tunix's DPOTrainer on the same data and weights, in its own interpreter (tunix_dpo_worker.py)."""
    cmd = [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_dpo_worker.py"),
           "--ckpt", ckpt, "--ref", ref, "--warmup", str(warmup), "--steps", str(repeats)]
    if prompts:
        cmd += ["--prompts", prompts]
    try:
        w, watch = run_json_worker(cmd, f"tunix --ref {ref}")
    except RuntimeError as e:
        return dict(error=str(e))
    if w["checks"]["optimizer_steps"] != warmup + repeats or w["checks"]["params_changed"] == 0:
        return dict(error=f"tunix took {w['checks']['optimizer_steps']} optimizer steps and changed "
                          f"{w['checks']['params_changed']} parameters")
    return dict(stats=summary(w["step_times"]), step_times=w["step_times"], warmup_step_times=w["warmup_step_times"],
                first_call_s=w["first_call_s"], ref_precompute_s=w["ref_precompute_s"], setup_s=w["setup_s"],
                first_loss=w["first_loss"], last_loss=w["last_loss"], **tunix_row(w, watch, probe),
                tunix_version=w["settings"]["tunix"], jax_version=w["settings"]["jax"],
                note=f"tunix.sft.dpo.DPOTrainer (--ref {ref}) in a subprocess (tunix_dpo_worker.py); " + w["timing"])


# --------------------------------------------------------------------------- main

WORKERS = {"jax": run_jax, "trl": run_trl, "torch": run_torch}


def _markdown(r: dict) -> str:
    lines = ["| implementation | s/step min | median | max | runs | first-call compile s | peak RSS MiB | "
             "first loss | others' cores |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, res in r["results"].items():
        if "error" in res:
            lines.append(f"| {name} | failed: {res['error'][:80]} | | | | | | | |")
            continue
        s = res["stats"]
        compile_s = f"{res['compile_s']:.2f}" if "compile_s" in res else "-"
        others = res.get("cpu_watch", {}).get("others_cores", "-")
        lines.append(f"| {name} | {s['min_s']:.4f} | {s['median_s']:.4f} | {s['max_s']:.4f} | {s['runs']} | "
                     f"{compile_s} | {res['peak_rss_mib']:.0f} | {res['first_loss']:.4f} | {others} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default=None, help="workload_prompts.json (default: benchmarks/workload_prompts.json)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps (a smoke run, not a result)")
    ap.add_argument("--framework", choices=("all", *WORKERS), default="all")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--tunix-python", default=None,
                    help="a python with google-tunix installed: also run Tunix's DPOTrainer (tunix_dpo_worker.py)")
    ap.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.repeats = 1, 3
    d = make_data(load_workload(args.prompts))

    if args.worker:  # child process: one framework, one JSON line on stdout
        print("RESULT " + json.dumps(WORKERS[args.worker](args.ckpt, d, args.warmup, args.repeats)), flush=True)
        return

    names = list(WORKERS) if args.framework == "all" else [args.framework]
    t_start = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as ckpt:
        hf = hf_llama(seed=0)
        hf.save_pretrained(ckpt, safe_serialization=True)
        probe = None
        if args.tunix_python:  # the torch model's logits, to check Tunix's model against
            import torch

            with torch.no_grad():
                probe = hf(torch.as_tensor(d["prompt_ids"][:1]).long()).logits[0, -1].double().numpy()
        del hf
        for name in names:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--ckpt", ckpt,
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
            if args.prompts:
                cmd += ["--prompts", args.prompts]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                results[name] = dict(error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
                print(f"[{name}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            else:
                results[name] = json.loads(line[0][len("RESULT "):])
        if args.tunix_python:
            for ref, name in (("per-step", "tunix"), ("precomputed", "tunix (ref precomputed)")):
                results[name] = _run_tunix(args.tunix_python, ckpt, ref, probe, args.warmup, args.repeats,
                                           args.prompts)
    contended = any(r.get("cpu_watch", {}).get("contended", False) for r in results.values())
    report = dict(workload=dict(pairs=B, prompt_len=P, response_len=T, beta=BETA, lr=LR, dtype="float32"),
                  warmup=args.warmup, repeats=args.repeats, quick=args.quick, results=results,
                  contended=contended, loadavg=os.getloadavg(), total_s=time.perf_counter() - t_start)
    print(_markdown(report))
    ours = results.get("jax", {}).get("stats")
    for name, res in results.items():
        if name.startswith("tunix") and "error" not in res:
            line = f"\n{name}: same model as torch (max |logit diff| {res['same_model_max_abs_logit_diff']:.1e}); " \
                   f"differs in: {'; '.join(res['differences'])}"
            if ours:
                ratio = res["stats"]["median_s"] / ours["median_s"]
                report.setdefault("ratios", {})[f"{name} / jax"] = ratio
                line += f"\n{name} / jaxrlhf median step time: {ratio:.2f}x"
            print(line)
    if contended:
        print("\nNOTE: other processes used CPU during the timed loops (contended: true): not a valid result.")
    path = write_json(args.out, "bench_dpo.json", report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
