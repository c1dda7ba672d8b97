"""Write a PEFT LoRA adapter for a decoder, to exercise the shared-backbone embedding path offline.

No trained SmolLM2 embedding adapter is available without the hub, so this writes an untrained one: with
`--init identity` (PEFT's default, B = 0) the adapted model equals the backbone; `--init random` perturbs it.

    python scripts/make_lora_adapter.py --out runs/adapters/smollm2-identity
"""

from __future__ import annotations

import argparse
import logging

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from orthrus_rag.models.registry import resolve_model_path

logger = logging.getLogger("make_lora_adapter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=16)
    ap.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    ap.add_argument("--init", choices=["identity", "random"], default="identity")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(args.model)), dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=args.targets,
                        init_lora_weights=args.init == "identity")
    peft_model = get_peft_model(model, config)
    if args.init == "random":
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
    peft_model.save_pretrained(args.out)
    logger.info("wrote a %s LoRA adapter (r=%d) to %s", args.init, args.rank, args.out)


if __name__ == "__main__":
    main()
