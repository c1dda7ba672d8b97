"""Turn a fully fine-tuned model into a LoRA adapter on its base: the truncated SVD of each Linear's difference.

For each Linear weight, delta = tuned - base = U S V^T; rank r keeps B = U_r S_r (out x r) and A = V_r^T (r x in),
which PEFT applies as `x @ A^T @ B^T * lora_alpha / r` (here lora_alpha = r, so the scale is 1) and which is the
best rank-r approximation in Frobenius norm (Eckart-Young). The share of delta's energy it keeps,
sum(S_r^2) / sum(S^2), is reported per module and per layer.

Parameters that are not matrices of a Linear (norm weights, the token-embedding table) do not compress that way;
they are kept whole in `full_deltas.safetensors` (layers/row_deltas.py), which the engine applies to the
adapter's rows and PEFT ignores. `lm_head` is skipped: embedding rows never reach it. A Linear bias that changed
is refused (neither file format carries it).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orthrus_rag.layers.row_deltas import FULL_DELTAS_FILE

logger = logging.getLogger(__name__)

_EMBED = "model.embed_tokens.weight"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SVD_FP64_MAX = 4_000_000  # elements; above this, fp32 SVD (fp64 doubles the time and memory of a 7B's MLPs)


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """All safetensors tensors of a folder, named as in a *ForCausalLM ("model.layers.0...", "lm_head.weight"):
    a bare-body checkpoint (Qwen3Model, e5-mistral's MistralModel) has no "model." prefix."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = key if key.startswith(("model.", "lm_head.")) else f"model.{key}"
                tensors[name] = f.get_tensor(key).float()
    return tensors


@dataclass
class ModuleReport:
    name: str
    shape: tuple[int, ...]
    energy_kept: float  # share of ||delta||_F^2 the rank-r factors keep (1.0 for a full delta)
    delta_energy: float  # ||delta||_F^2


@dataclass
class ExtractionReport:
    rank: int
    low_rank: list[ModuleReport] = field(default_factory=list)
    full: list[ModuleReport] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def per_layer(self) -> dict[str, float]:
        """Energy kept per decoder layer over its low-rank modules ("0", "1", ..., or "other")."""
        kept: dict[str, float] = {}
        total: dict[str, float] = {}
        for m in self.low_rank:
            match = _LAYER_RE.match(m.name)
            layer = match.group(1) if match else "other"
            kept[layer] = kept.get(layer, 0.0) + m.energy_kept * m.delta_energy
            total[layer] = total.get(layer, 0.0) + m.delta_energy
        return {k: kept[k] / total[k] if total[k] > 0 else 1.0 for k in sorted(total, key=_layer_order)}

    def to_json(self) -> dict:
        return {"rank": self.rank, "energy_kept_per_layer": self.per_layer(),
                "low_rank": [vars(m) for m in self.low_rank], "full": [vars(m) for m in self.full],
                "unchanged": self.unchanged, "skipped": self.skipped}


def _layer_order(key: str) -> tuple[int, int]:
    return (0, int(key)) if key.isdigit() else (1, 0)


def low_rank_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [rank, in], B [out, rank], energy kept) of the best rank-r approximation B @ A of `delta` [out, in].
    A matrix narrower than `rank` is recovered exactly at its own rank and padded with zero rows of A and
    columns of B: PEFT's `r` is one number for every module."""
    work = delta.double() if delta.numel() <= _SVD_FP64_MAX else delta.float()
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    r = min(rank, s.numel())
    energy = float((s[:r] ** 2).sum() / (s ** 2).sum()) if s.abs().max() > 0 else 1.0
    a = torch.zeros(rank, delta.shape[1], dtype=torch.float32)
    b = torch.zeros(delta.shape[0], rank, dtype=torch.float32)
    a[:r], b[:, :r] = vh[:r].float(), (u[:, :r] * s[:r]).float()
    return a, b, energy


def extract(base: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor], rank: int
            ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor], ExtractionReport]:
    """LoRA factors {module: (A, B)}, full deltas {module: delta} and the report, for `tuned` over `base`."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    report = ExtractionReport(rank)
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    for name in sorted(tuned):
        if name.startswith("lm_head.") or "rotary_emb" in name:
            report.skipped.append(name)
            continue
        if name not in base:
            raise ValueError(f"tuned model has {name!r}, which the base lacks: not a fine-tune of this base")
        if tuned[name].shape != base[name].shape:
            raise ValueError(f"{name}: tuned {tuple(tuned[name].shape)} vs base {tuple(base[name].shape)}")
        delta = tuned[name] - base[name]
        if not delta.any():
            report.unchanged.append(name)
            continue
        module, _, kind = name.rpartition(".")
        energy = float((delta.double() ** 2).sum())
        if kind == "bias":
            raise ValueError(f"{name} changed; bias deltas are not supported (neither LoRA nor full deltas)")
        if delta.dim() == 2 and name != _EMBED:
            a, b, kept = low_rank_factors(delta, rank)
            lora[module] = (a, b)
            report.low_rank.append(ModuleReport(name, tuple(delta.shape), kept, energy))
        else:
            full[module] = delta.contiguous()
            report.full.append(ModuleReport(name, tuple(delta.shape), 1.0, energy))
    missing = sorted(set(base) - set(tuned) - {"lm_head.weight"})
    if missing:
        raise ValueError(f"tuned model lacks {len(missing)} of the base's weights, e.g. {missing[:3]}")
    return lora, full, report


def write_adapter(out: Path, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], full: dict[str, torch.Tensor],
                  rank: int, base_name: str, report: ExtractionReport) -> None:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), the full deltas and the report.
    Into a folder that held an adapter, the files of it that this one does not replace are removed."""
    if not lora:
        raise ValueError("no Linear weight differs between the two models: nothing to extract")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in lora.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_name, "r": rank,
              "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "target_modules": sorted(lora), "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if full:
        save_file({f"{m}.weight": d for m, d in full.items()}, str(out / FULL_DELTAS_FILE))
    _remove_stale(out, keep={FULL_DELTAS_FILE} if full else set())
    (out / "extraction_report.json").write_text(json.dumps(report.to_json(), indent=2))
    logger.info("wrote rank-%d adapter to %s: %d LoRA modules, %d full deltas", rank, out, len(lora), len(full))


# files an adapter loader reads that a write may leave out: the previous adapter's would load with the new one
# (its full deltas onto the new factors; PEFT's older weight file, where a tool reads it before the safetensors)
_OPTIONAL_FILES = (FULL_DELTAS_FILE, "adapter_model.bin")


def _remove_stale(out: Path, keep: set[str]) -> None:
    for name in _OPTIONAL_FILES:
        if name not in keep and (out / name).is_file():
            logger.info("removing %s: left by the adapter previously written to %s", name, out)
            (out / name).unlink()
