"""GPU check of the HF <-> Megatron bridge with the Transformer-Engine layer spec (run by hand on a
machine with CUDA; not collected by pytest).

    python tests/gpu/check_convert_te.py

For each family's tiny random model: converts HF -> dist checkpoint with tools/ (CPU), then on the
GPU builds the GPTModel with the TE spec (the local spec if transformer_engine does not import),
loads it (1) from HF with load_hf_weights and (2) from the converted checkpoint with
load_model_weights (TE's fused norm names and missing ``_extra_state``), and checks fp32 logits
against transformers (<= 2e-3: TE kernels) and export_hf_weights against the HF tensors (bit for
bit). Prints one line per check and exits non-zero on any failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    import transformers
    from safetensors.torch import load_file

    from megatron_entropy.models.arch import load_arch
    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model, transformer_engine_available
    from megatron_entropy.models.megatron_checkpoint import load_model_weights
    from megatron_entropy.runtime import init_distributed, set_seed
    from megatron_entropy.testing.toy_models import FAMILIES, save_tiny_hf_model

    assert torch.cuda.is_available(), "this check needs a GPU"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    init_distributed(1, 1)
    set_seed(0)
    impl = "transformer_engine" if transformer_engine_available() else "local"
    print(f"layer spec: {impl}")
    failures = 0
    root = Path(tempfile.mkdtemp(prefix="check_convert_te_"))
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    for family in FAMILIES:
        hf_dir = save_tiny_hf_model(family, root / family)
        ckpt = root / f"{family}_mcore"
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), "--hf-dir",
                        str(hf_dir), "--out", str(ckpt), "--dtype", "fp32", "--quiet"], check=True)
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            ref = ref_model(tokens).logits
        ref_tensors = load_file(hf_dir / "model.safetensors")
        arch = load_arch(hf_dir)
        for source in ("hf", "ckpt"):
            model = build_gpt_model(arch, 1, 1, "fp32", impl, seq_length=64)
            if source == "hf":
                load_hf_weights(model, hf_dir, arch)
            else:
                load_model_weights(model, ckpt)
            gpu_tokens = tokens.cuda()
            pos = torch.arange(tokens.shape[1], device="cuda").expand_as(gpu_tokens)
            with torch.no_grad():
                logits = model(gpu_tokens, pos, None)[..., :1000].float().cpu()
            err = (logits - ref).abs().max().item()
            ok = err <= 2e-3
            exported = {n: t.cpu() for n, t in export_hf_weights(model, arch)}
            same = exported.keys() == ref_tensors.keys() and all(
                torch.equal(t, ref_tensors[n]) for n, t in exported.items())
            print(f"{'PASS' if ok and same else 'FAIL'} {family:8s} from {source:4s}: "
                  f"max |logit diff| {err:.2e}, export bit-identical {same}")
            failures += not (ok and same)
    shutil.rmtree(root, ignore_errors=True)
    print("all passed" if not failures else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
