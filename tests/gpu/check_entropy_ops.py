"""GPU check of the entropy ops (one CUDA device, TP=1; needs only torch and this package).

    python tests/gpu/check_entropy_ops.py            # ~1 minute on an H200

1. Correctness on CUDA: float64 log-prob/entropy and gradients of both paths equal torch's
   log_softmax on the same logits (extreme rows, padded vocab); fp32 and bf16 logits with common
   offsets of +-1e4 (temperatures 1 and 0.7) give log-probs and entropies within 1e-6 relative
   of float64 on the same values, and fp32 gradients within 1e-6 of their largest entry.
2. Speed and memory at T=8192, V=151936 (bf16 logits, as a Qwen2.5 LM head gives): fwd+bwd time
   (CUDA events) and peak allocated memory beyond the inputs (torch.cuda.max_memory_allocated)
   for ours (chunked), ours (fused, H=4096), and plain torch (full float32 log_softmax); also
   verl 0.9's Megatron path if verl imports (it usually does not on the GPU box: no network).
Exits 1 if a correctness check fails. Prints one line per measurement.
"""

from __future__ import annotations

import sys

import torch

from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                  vocab_parallel_logprob_entropy)


def reference(logits, targets, vocab):
    x = logits[:, :vocab].double().detach().requires_grad_()
    logsm = torch.log_softmax(x, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent, x


def check_correctness(dev) -> bool:
    ok = True
    g = torch.Generator(device="cpu").manual_seed(0)
    T, V, vocab, H = 300, 1024, 1000, 64
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3)
    logits[0] *= 1e3
    logits[1] += 1e4
    logits[:, vocab:] = float("nan")  # padding is never read
    targets = torch.randint(0, vocab, (T,), generator=g)
    up = torch.randn(2, T, generator=g, dtype=torch.float64)
    logits, targets, up = logits.to(dev), targets.to(dev), up.to(dev)

    ref_lp, ref_ent, x = reference(logits, targets, vocab)
    (ref_lp * up[0] + ref_ent * up[1]).sum().backward()
    leaf = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprob_entropy(leaf, targets, vocab_size=vocab, chunk_tokens=64)
    (lp * up[0] + ent * up[1]).sum().backward()
    errs = {"fp64 logp": (lp - ref_lp).abs().max(), "fp64 entropy": (ent - ref_ent).abs().max(),
            "fp64 grad": (leaf.grad[:, :vocab] - x.grad).abs().max()}
    errs = {k: float(v.detach()) for k, v in errs.items()}
    for name, err in errs.items():
        good = float(err) < 1e-9
        ok &= good
        print(f"[{'ok' if good else 'FAIL'}] chunked {name} max err {float(err):.2e}")

    hidden = torch.randn(T, H, generator=g, dtype=torch.float64).to(dev).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dev).requires_grad_()
    lp, ent = fused_linear_logprob_entropy(hidden, weight, targets, vocab_size=vocab,
                                           chunk_tokens=64)
    (lp * up[0] + ent * up[1]).sum().backward()
    h2 = hidden.detach().clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    logsm = torch.log_softmax(h2 @ w2[:vocab].t(), dim=-1)
    r_ent = -(logsm.exp() * logsm).sum(-1)
    (logsm.gather(1, targets[:, None]).squeeze(1) * up[0] + r_ent * up[1]).sum().backward()
    for name, a, b in [("logp", lp, logsm.gather(1, targets[:, None]).squeeze(1)),
                       ("entropy", ent, r_ent), ("grad hidden", hidden.grad, h2.grad),
                       ("grad weight", weight.grad[:vocab], w2.grad[:vocab])]:
        err = float((a - b).abs().max())
        good = err < 1e-8
        ok &= good
        print(f"[{'ok' if good else 'FAIL'}] fused fp64 {name} max err {err:.2e}")

    return ok


def check_offsets(dev) -> bool:
    """Rows near +1e4, -1e4 and 0, where half an fp32 step is 5e-4: still fp32 precision."""
    ok = True
    g = torch.Generator(device="cpu").manual_seed(1)
    T, V, vocab = 300, 1024, 1000
    offsets = torch.tensor([1e4, -1e4, 0.0], dtype=torch.float64).repeat(T // 3)[:, None]
    base = torch.randn(T, V, generator=g, dtype=torch.float64) * 3 + offsets
    targets = torch.randint(0, vocab, (T,), generator=g).to(dev)
    up = torch.randn(2, T, generator=g, dtype=torch.float64).to(dev)
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7):
            logits = base.to(dtype).to(dev)
            logits[:, vocab:] = float("nan")  # padding is never read
            x = logits[:, :vocab].double().requires_grad_()
            logsm = torch.log_softmax(x / temperature, dim=-1)
            ref_lp = logsm.gather(1, targets[:, None]).squeeze(1)
            ref_ent = -(logsm.exp() * logsm).sum(-1)
            (ref_lp * up[0] + ref_ent * up[1]).sum().backward()
            leaf = logits.clone().requires_grad_()
            lp, ent = vocab_parallel_logprob_entropy(leaf, targets, vocab_size=vocab,
                                                     temperature=temperature, chunk_tokens=64)
            (lp * up[0].float() + ent * up[1].float()).sum().backward()
            lp, ent, ref_lp, ref_ent = lp.detach(), ent.detach(), ref_lp.detach(), ref_ent.detach()
            # 1e-6 relative, absolute below 1 (as tests/unit/ops/test_logprob_entropy.py).
            errs = {"logp": float(((lp.double() - ref_lp).abs() / (1 + ref_lp.abs())).max()),
                    "entropy": float(((ent.double() - ref_ent).abs() / (1 + ref_ent.abs())).max())}
            if dtype == torch.float32:
                errs["grad"] = float((leaf.grad[:, :vocab].double() - x.grad).abs().max()
                                     / x.grad.abs().max())
            for name, err in errs.items():
                good = err <= 1e-6 and lp.dtype == torch.float32
                ok &= good
                print(f"[{'ok' if good else 'FAIL'}] offsets +-1e4 {str(dtype)[6:]} "
                      f"T={temperature} {name} max rel err {err:.2e}")
    return ok


def _torch_path(logits, targets):
    logsm = torch.log_softmax(logits.float(), dim=-1)
    return logsm.gather(1, targets[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1)


def measure(dev, T=8192, V=151936, H=4096, chunk=1024) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    targets = torch.randint(0, V, (T,), device=dev, generator=g)
    methods = {
        "ours-chunked": lambda x: vocab_parallel_logprob_entropy(x["logits"], targets,
                                                                 chunk_tokens=chunk),
        "torch": lambda x: _torch_path(x["logits"], targets),
        "ours-fused": lambda x: fused_linear_logprob_entropy(x["hidden"], x["weight"], targets,
                                                             chunk_tokens=chunk),
    }
    try:
        from verl.utils.megatron.tensor_parallel import (vocab_parallel_entropy,
                                                         vocab_parallel_log_probs_from_logits)

        def verl_path(x):
            logits = x["logits"]
            ent = vocab_parallel_entropy(logits.clone())
            return vocab_parallel_log_probs_from_logits(logits, targets), ent.float()

        methods["verl"] = verl_path  # needs Megatron's parallel state (TP=1) initialised
    except Exception as e:  # noqa: BLE001
        print(f"verl unavailable here ({type(e).__name__}); its rows are skipped")
    for name, fn in methods.items():
        if name == "ours-fused":
            x = {"hidden": torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
                 .requires_grad_(),
                 "weight": (torch.randn(V, H, device=dev, generator=g) / 64).to(torch.bfloat16)
                 .requires_grad_()}
        else:
            x = {"logits": (torch.randn(T, V, device=dev, generator=g) * 2).to(torch.bfloat16)
                 .requires_grad_()}
        try:
            for rep in range(3):
                for leaf in x.values():
                    leaf.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                start.record()
                lp, ent = fn(x)
                mid.record()
                (lp.sum() + 1e-3 * ent.sum()).backward()
                end.record()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                del lp, ent
            print(f"{name:13s} T={T} V={V} bf16: fwd {start.elapsed_time(mid):8.2f} ms  fwd+bwd "
                  f"{start.elapsed_time(end):8.2f} ms  peak beyond inputs {peak:6.2f} GiB")
        except torch.OutOfMemoryError:
            print(f"{name:13s} out of memory")
        except Exception as e:  # noqa: BLE001 - e.g. verl without Megatron's parallel state
            print(f"{name:13s} failed: {type(e).__name__}: {e}"[:200])
        del x
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dev = torch.device("cuda")
    ok = check_correctness(dev)
    ok &= check_offsets(dev)
    measure(dev)
    print("ALL OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
