"""Write a PEFT LoRA adapter for a decoder, to exercise the adapter paths offline (embedding and generation).

No trained SmolLM2 adapter is available without the hub, so this writes an untrained one: with `--init identity`
(PEFT's default, B = 0) the adapted model equals the backbone; `--init random` perturbs it (`--scale` of PEFT's
random B).

    python scripts/make_lora_adapter.py --out runs/adapters/smollm2-identity
    python scripts/make_lora_adapter.py --out runs/adapters/gen-a --init random --seed 1 --targets q_proj v_proj up_proj
"""

from __future__ import annotations

import argparse
import logging

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from orthrus_rag.models.registry import resolve_model_path

logger = logging.getLogger("make_lora_adapter")


def make_adapter(model: torch.nn.Module, out: str, rank: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, init: str = "identity", seed: int = 0,
                 scale: float = 0.05) -> torch.nn.Module:
    """Write an adapter for `model` (left unchanged) to `out`; returns the PEFT-merged model (the reference an
    engine running the adapter must equal)."""
    import copy

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=init == "identity")
    peft_model = get_peft_model(copy.deepcopy(model), config)
    if init == "random":
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale)
    peft_model.save_pretrained(out)
    logger.info("wrote a %s LoRA adapter (r=%d) to %s", init, rank, out)
    return peft_model.merge_and_unload().eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    ap.add_argument("--init", choices=["identity", "random"], default="identity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.05, help="--init random: factor on PEFT's random B")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(args.model)), dtype=torch.float32)
    make_adapter(model, args.out, args.rank, args.alpha, args.targets, args.init, args.seed, args.scale)


if __name__ == "__main__":
    main()
