"""Where an addition model goes wrong: greedy answers to all 10,000 two-digit sums.

    python benchmarks/addition_errors.py /tmp/addition_grpo/export

Reads a run's exported folder (`configs/addition_grpo.py` and the other addition configs
write `<workdir>/export`), decodes every "a+b=" for a, b in 0..99 greedily, and prints the
exact-match rate over all sums, the held-out split and the training split, then by carry
class (a carry out of the ones digit; a three-digit sum), which answer digits were wrong,
and the first wrong answers. Not a timing: docs/results.md uses it to say what errors
are left after GRPO.
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.data import EOS_ID, PAD_ID, CharTokenizer
from jaxrlhf.data import arithmetic
from jaxrlhf.models import load_pretrained
from jaxrlhf.rollout import generate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export", help="an exported Hugging Face folder of an addition run")
    ap.add_argument("--show", type=int, default=20, help="wrong answers to print")
    args = ap.parse_args()
    task, tok = arithmetic.AdditionTask(num_digits=2), CharTokenizer()
    model, params = load_pretrained(args.export)
    a, b = np.divmod(np.arange(10_000), 100)
    prompts = [tok.encode(arithmetic.format_prompt(task, x, y), add_bos=True) for x, y in zip(a, b)]
    width = max(map(len, prompts))
    ids, mask = np.zeros((a.size, width), np.int32), np.zeros((a.size, width), bool)
    for i, p in enumerate(prompts):  # left-padded
        ids[i, width - len(p):], mask[i, width - len(p):] = p, True
    answers = []
    for s in range(0, a.size, 1000):
        out = generate(model, params, jnp.asarray(ids[s:s + 1000]), jnp.asarray(mask[s:s + 1000]), jax.random.key(0),
                       max_new_tokens=task.response_len, temperature=0.0, eos_id=EOS_ID, pad_id=PAD_ID)
        answers += [tok.decode([t for t in row if t not in (EOS_ID, PAD_ID)]) for row in np.asarray(out.response_ids)]
    truth = [arithmetic.format_answer(task, x + y) for x, y in zip(a, b)]
    right = np.array([g == t for g, t in zip(answers, truth)])
    held = arithmetic.is_held_out(task, a, b)
    print(f"exact match: all {right.mean():.4f}, held-out {right[held].mean():.4f}, training {right[~held].mean():.4f}")
    ones, hundreds = (a % 10 + b % 10) >= 10, (a + b) >= 100
    for name, m in (("no carry", ~ones & ~hundreds), ("ones carry, two-digit sum", ones & ~hundreds),
                    ("no ones carry, three-digit sum", ~ones & hundreds), ("ones carry, three-digit sum", ones & hundreds)):
        print(f"  {name:32s} {m.sum():5d} sums  exact match {right[m].mean():.3f}")
    where = collections.Counter()
    for i in np.flatnonzero(~right):
        g, t = answers[i], truth[i]
        where["length" if len(g) != len(t) else f"digit {[k for k in range(len(t)) if g[k] != t[k]]} of {len(t)}"] += 1
    print("wrong answers by position:", ", ".join(f"{k}: {v}" for k, v in where.most_common()))
    print("first wrong:", ", ".join(f"{a[i]}+{b[i]}={answers[i]!r}" for i in np.flatnonzero(~right)[:args.show]))


if __name__ == "__main__":
    main()
