"""Float64 NumPy references for `jaxrlhf.ops`, written from docs/concepts.md with explicit
loops.

Deliberately naive and independent of the implementation: python loops over `b` and `t`,
`math` for scalars, and the formulas of docs/concepts.md read literally. Masks are 0/1 and
valid tokens a contiguous prefix of length `len_b = Σ_t mask[b, t]`, except for
`gae_policy_tokens`, whose masks may have holes.
"""

import math

import numpy as np


def _f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


def _log_sigmoid(z):
    # log σ(z) = −log(1 + e^{−z}), written to avoid overflow for either sign of z.
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def token_logprobs(logits, targets, temperature=1.0):
    (logits,) = _f64(logits)
    b_size, t_size, v_size = logits.shape
    out = np.zeros((b_size, t_size))
    for b in range(b_size):
        for t in range(t_size):
            x = [logits[b, t, v] / temperature for v in range(v_size)]
            m = max(x)
            lse = m + math.log(sum(math.exp(xv - m) for xv in x))
            out[b, t] = x[int(targets[b, t])] - lse
    return out


def entropy(logits, temperature=1.0):
    (logits,) = _f64(logits)
    b_size, t_size, v_size = logits.shape
    out = np.zeros((b_size, t_size))
    for b in range(b_size):
        for t in range(t_size):
            x = [logits[b, t, v] / temperature for v in range(v_size)]
            m = max(x)
            z = sum(math.exp(xv - m) for xv in x)
            h = 0.0
            for xv in x:
                p = math.exp(xv - m) / z
                if p > 0:
                    h -= p * math.log(p)
            out[b, t] = h
    return out


def kl(logp, ref_logp, estimator):
    logp, ref_logp = _f64(logp, ref_logp)
    out = np.zeros(logp.shape)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            d = logp[b, t] - ref_logp[b, t]
            if estimator == "k1":
                out[b, t] = d
            elif estimator == "k2":
                out[b, t] = d * d / 2
            else:
                out[b, t] = math.exp(-d) - 1 + d
    return out


def shape_rewards(scores, kl_bt, mask, beta):
    scores, kl_bt, mask = _f64(scores, kl_bt, mask)
    out = np.zeros(kl_bt.shape)
    for b in range(kl_bt.shape[0]):
        length = int(sum(mask[b]))
        for t in range(kl_bt.shape[1]):
            if mask[b, t]:
                out[b, t] = -beta * kl_bt[b, t]
            if t == length - 1:
                out[b, t] += scores[b]
    return out


def gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE per position: δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t, A_t = δ_t + γλ·m_{t+1}·A_{t+1}.
    GAE itself on a contiguous-prefix mask; on a mask with holes it cuts the chain at every
    hole (what `ops.gae` computed before episodes: see `gae_policy_tokens`)."""
    rewards, values, mask = _f64(rewards, values, mask)
    b_size, t_size = rewards.shape
    adv = np.zeros((b_size, t_size))
    ret = np.zeros((b_size, t_size))
    for b in range(b_size):
        next_adv = 0.0
        for t in reversed(range(t_size)):
            if not mask[b, t]:
                next_adv = 0.0
                continue
            m_next = mask[b, t + 1] if t + 1 < t_size else 0.0
            v_next = values[b, t + 1] if m_next else 0.0
            delta = rewards[b, t] + gamma * v_next * m_next - values[b, t]
            a = delta + gamma * lam * m_next * next_adv
            adv[b, t] = a
            ret[b, t] = a + values[b, t]
            next_adv = a
    return adv, ret


def gae_policy_tokens(rewards, values, mask, gamma=1.0, lam=0.95):
    """GAE over each row's policy tokens `t_1 < … < t_n` (the positions where the mask is 1),
    whatever lies between them (docs/concepts.md#gae-over-a-mask-with-holes):

        δ_i = r_{t_i} + γ·V_{t_{i+1}} − V_{t_i}  (V_{t_{n+1}} = 0),  A_i = δ_i + γλ·A_{i+1},
        R_i = A_i + V_{t_i};  0 everywhere else.

    On a contiguous-prefix mask it is `gae` above (the per-position form, which cuts the
    chain at any 0 of the mask).
    """
    rewards, values, mask = _f64(rewards, values, mask)
    adv = np.zeros(rewards.shape)
    ret = np.zeros(rewards.shape)
    for b in range(rewards.shape[0]):
        policy = [t for t in range(rewards.shape[1]) if mask[b, t]]
        for i in reversed(range(len(policy))):
            t = policy[i]
            last = i + 1 == len(policy)
            v_next = 0.0 if last else values[b, policy[i + 1]]
            a_next = 0.0 if last else adv[b, policy[i + 1]]
            delta = rewards[b, t] + gamma * v_next - values[b, t]
            adv[b, t] = delta + gamma * lam * a_next
            ret[b, t] = adv[b, t] + values[b, t]
    return adv, ret


def whiten(x, mask, shift_mean=True, eps=1e-8):
    x, mask = _f64(x, mask)
    vals = [x[b, t] for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    out = np.zeros(x.shape)
    if not vals:
        return out
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                w = (x[b, t] - mu) / math.sqrt(var + eps)
                out[b, t] = w if shift_mean else w + mu
    return out


def group_advantages(scores, group_size, method="grpo", eps=1e-6):
    (scores,) = _f64(scores)
    out = np.zeros(scores.shape)
    for start in range(0, len(scores), group_size):
        group = list(scores[start : start + group_size])
        mean = sum(group) / group_size
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (group_size - 1))
        for i, s in enumerate(group):
            if method == "grpo":
                out[start + i] = (s - mean) / (std + eps)
            elif method == "dr_grpo":
                out[start + i] = s - mean
            else:
                others = sum(group) - s
                out[start + i] = s - others / (group_size - 1)
    return out



def masked_group_advantages(scores, mask, group_size, method="grpo", eps=1e-6):
    """Each group's advantages over its scored rows alone; 0 for the others and for a group
    with fewer than two scored rows."""
    (scores,) = _f64(scores)
    out = np.zeros(scores.shape)
    for start in range(0, len(scores), group_size):
        rows = [start + i for i in range(group_size) if mask[start + i]]
        if len(rows) >= 2:
            out[rows] = group_advantages(scores[rows], len(rows), method, eps)
    return out

def aggregate(x, mask, mode="token-mean", norm_len=None):
    x, mask = _f64(x, mask)
    b_size, t_size = x.shape
    if mode == "token-mean":
        num = sum(x[b, t] for b in range(b_size) for t in range(t_size) if mask[b, t])
        den = sum(mask[b, t] for b in range(b_size) for t in range(t_size))
        return num / den if den else 0.0
    if mode == "seq-mean-token-mean":
        total = 0.0
        for b in range(b_size):
            n = sum(mask[b])
            if n:
                total += sum(x[b, t] for t in range(t_size) if mask[b, t]) / n
        return total / b_size
    total = sum(x[b, t] for b in range(b_size) for t in range(t_size) if mask[b, t])
    if mode == "seq-mean-token-sum":
        return total / b_size
    return total / (b_size * norm_len)


def policy_loss(
    logp, old_logp, advantages, mask, clip_low=0.2, clip_high=None, dual_clip=None,
    agg="token-mean", norm_len=None, is_weights=None,
):
    logp, old_logp, advantages, mask = _f64(logp, old_logp, advantages, mask)
    weights = np.ones(logp.shape) if is_weights is None else _f64(is_weights)[0]
    if clip_high is None:
        clip_high = clip_low
    per_token = np.zeros(logp.shape)
    clipped_count, count, kl_sum, ratios = 0, 0, 0.0, []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            a = advantages[b, t]
            rho = math.exp(logp[b, t] - old_logp[b, t])
            l1 = -a * rho
            l2 = -a * min(max(rho, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            if dual_clip is not None and a < 0:
                loss = min(loss, -dual_clip * a)
            per_token[b, t] = weights[b, t] * loss
            count += 1
            clipped_count += l2 > l1
            kl_sum += rho - 1 - math.log(rho)
            ratios.append(rho)
    metrics = {
        "clipfrac": clipped_count / count if count else 0.0,
        "approx_kl": kl_sum / count if count else 0.0,
        "ratio_mean": sum(ratios) / count if count else 0.0,
        "ratio_max": max(ratios) if ratios else 0.0,
        "ratio_min": min(ratios) if ratios else 0.0,
    }
    return aggregate(per_token, mask, agg, norm_len), metrics


def cispo_loss(
    logp, old_logp, advantages, mask, clip_low=1.0, clip_high=4.0, is_weights=None,
    agg="token-mean", norm_len=None,
):
    """Returns (loss, metrics, dloss/dlogp): the gradient −w·clip(ρ)·A/den of token-mean
    is the REINFORCE term with the clipped ratio held constant (for agg="token-mean")."""
    logp, old_logp, advantages, mask = _f64(logp, old_logp, advantages, mask)
    weights = np.ones(logp.shape) if is_weights is None else _f64(is_weights)[0]
    per_token = np.zeros(logp.shape)
    coef = np.zeros(logp.shape)
    clipped_count, count, kl_sum, ratios = 0, 0, 0.0, []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            rho = math.exp(logp[b, t] - old_logp[b, t])
            rho_clip = min(max(rho, 1 - clip_low), 1 + clip_high)
            coef[b, t] = -weights[b, t] * rho_clip * advantages[b, t]
            per_token[b, t] = coef[b, t] * logp[b, t]
            count += 1
            clipped_count += rho_clip != rho
            kl_sum += rho - 1 - math.log(rho)
            ratios.append(rho)
    metrics = {
        "clipfrac": clipped_count / count if count else 0.0,
        "approx_kl": kl_sum / count if count else 0.0,
        "ratio_mean": sum(ratios) / count if count else 0.0,
        "ratio_max": max(ratios) if ratios else 0.0,
        "ratio_min": min(ratios) if ratios else 0.0,
    }
    grad = coef / count if count else coef
    return aggregate(per_token, mask, agg, norm_len), metrics, grad


def importance_weights(proximal, behaviour, mask, mode="tis", cap=2.0, low=0.5, high=5.0, level="token"):
    proximal, behaviour, mask = _f64(proximal, behaviour, mask)
    b_size, t_size = proximal.shape
    weights = np.zeros(proximal.shape)
    outside, kls, diffs = 0, [], []
    for b in range(b_size):
        deltas = [proximal[b, t] - behaviour[b, t] for t in range(t_size) if mask[b, t]]
        for t in range(t_size):
            if not mask[b, t]:
                continue
            if level == "token":
                r = math.exp(proximal[b, t] - behaviour[b, t])
            elif level == "sequence":
                r = math.exp(min(max(sum(deltas), -20.0), 20.0))
            else:
                r = math.exp(sum(deltas) / len(deltas))
            if mode == "tis":
                weights[b, t] = min(r, cap)
                outside += r > cap
            elif mode == "mis":
                inside = low <= r <= high
                weights[b, t] = r if inside else 0.0
                outside += not inside
            else:
                weights[b, t] = 1.0
            d = behaviour[b, t] - proximal[b, t]
            kls.append(math.exp(-d) - 1 + d)
            diffs.append(abs(d))
    n = len(kls)
    valid = [weights[b, t] for b in range(b_size) for t in range(t_size) if mask[b, t]]
    metrics = {
        "is_weight_mean": sum(valid) / n if n else 0.0,
        "is_weight_max": max(valid) if n else 0.0,
        "is_frac_truncated": outside / n if n else 0.0,
        "mismatch_kl": sum(kls) / n if n else 0.0,
        "max_abs_logp_diff": max(diffs) if n else 0.0,
    }
    return weights, metrics


def _zscore(values, eps):
    """Population (ddof = 0) z-scores of a list; 0 for a list of equal values."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [0.0 if std == 0 else (v - mean) / (std + eps) for v in values]


def gdpo_advantages(scores, group_size, weights=None, eps=1e-6, mask=None):
    (scores,) = _f64(scores)
    n, k = scores.shape
    weights = [1.0] * k if weights is None else [float(w) for w in weights]
    scored = [True] * n if mask is None else [bool(x) for x in mask]
    combined = {}
    for start in range(0, n, group_size):
        rows = [start + i for i in range(group_size) if scored[start + i]]
        if not rows:
            continue
        total = {i: 0.0 for i in rows}
        for c in range(k):
            for i, z in zip(rows, _zscore([scores[i, c] for i in rows], eps)):
                total[i] += weights[c] * z
        combined.update(total)
    out = np.zeros(n)
    rows = sorted(combined)
    if rows:
        out[rows] = _zscore([combined[i] for i in rows], eps)
    return out


def reinforce_pp_baseline(scores, response_mask, group_size, scored=None):
    """Group-mean baseline over the scored rows, broadcast, whitened over the scored rows'
    valid tokens; 0 for an unscored row."""
    (scores,) = _f64(scores)
    n = len(scores)
    scored = [True] * n if scored is None else [bool(x) for x in scored]
    centred = np.zeros(n)
    for start in range(0, n, group_size):
        rows = [start + i for i in range(group_size) if scored[start + i]]
        for i in rows:
            centred[i] = scores[i] - sum(scores[j] for j in rows) / len(rows)
    mask = np.asarray(response_mask, np.float64) * np.asarray(scored, np.float64)[:, None]
    return whiten(centred[:, None] * mask, mask)


def distillation_advantages(teacher_logp, old_logp, mask):
    teacher_logp, old_logp, mask = _f64(teacher_logp, old_logp, mask)
    out = np.zeros(teacher_logp.shape)
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            if mask[b, t]:
                out[b, t] = teacher_logp[b, t] - old_logp[b, t]
    return out


def value_loss(values, old_values, returns, mask, clip=0.2, agg="token-mean", norm_len=None):
    values, old_values, returns, mask = _f64(values, old_values, returns, mask)
    per_token = np.zeros(values.shape)
    clipped_count, count = 0, 0
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[b, t]:
                continue
            v, v_old, r = values[b, t], old_values[b, t], returns[b, t]
            e1 = (v - r) ** 2
            if clip is None:
                per_token[b, t] = 0.5 * e1
            else:
                v_clip = v_old + min(max(v - v_old, -clip), clip)
                e2 = (v_clip - r) ** 2
                per_token[b, t] = 0.5 * max(e1, e2)
                clipped_count += e2 > e1
            count += 1
    clipfrac = clipped_count / count if count else 0.0
    return aggregate(per_token, mask, agg, norm_len), {"clipfrac": clipfrac}


def dpo_loss(
    chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid",
    label_smoothing=0.0,
):
    chosen, rejected, ref_chosen, ref_rejected = _f64(chosen, rejected, ref_chosen, ref_rejected)
    losses, zs, correct = [], [], 0
    for i in range(len(chosen)):
        z = beta * ((chosen[i] - ref_chosen[i]) - (rejected[i] - ref_rejected[i]))
        if loss_type == "sigmoid":
            ls = label_smoothing
            losses.append(-(1 - ls) * _log_sigmoid(z) - ls * _log_sigmoid(-z))
        elif loss_type == "ipo":
            losses.append((z / beta - 1 / (2 * beta)) ** 2)
        else:
            losses.append(max(0.0, 1 - z))
        zs.append(z)
        correct += z > 0
    n = len(chosen)
    return sum(losses) / n, {"margin": sum(zs) / n, "reward_accuracy": correct / n}


def reward_model_loss(chosen, rejected, margin=None):
    chosen, rejected = _f64(chosen, rejected)
    n = len(chosen)
    margins = np.broadcast_to(np.zeros(()) if margin is None else np.asarray(margin, float), (n,))
    losses = [-_log_sigmoid(chosen[i] - rejected[i] - margins[i]) for i in range(n)]
    accuracy = sum(chosen[i] > rejected[i] for i in range(n)) / n
    return sum(losses) / n, {"accuracy": accuracy}
