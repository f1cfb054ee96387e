"""The MoE layer shapes of well-known models: what the tuner CLI, the benchmarks and `make run`
name a layer by. The same table is benchmarks/shapes.json (a test keeps the two equal)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    routing: str = "renormalize"
    activation: str = "swiglu"
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0
    bias: bool = False
    # the quant modes this model is served in (the ones worth tuning and benchmarking)
    quant: Tuple[str, ...] = field(default=("none",))

    @property
    def gated(self) -> bool:
        return self.activation != "relu2"

    @property
    def n13(self) -> int:
        """Rows of the fused gate/up weight of one expert."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size

    def layer_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of moe_ops.FusedMoE besides the sizes."""
        return dict(routing=self.routing, n_group=self.n_group, topk_group=self.topk_group,
                    routed_scaling_factor=self.routed_scaling_factor,
                    activation=self.activation, bias=self.bias)

    @classmethod
    def from_json(cls, name: str, entry: Dict[str, Any]) -> "MoEShape":
        return cls(name=name, num_experts=int(entry["num_experts"]),
                   hidden_size=int(entry["hidden_size"]),
                   intermediate_size=int(entry["intermediate_size"]), top_k=int(entry["top_k"]),
                   routing=entry.get("routing", "renormalize"),
                   activation=entry.get("activation", "swiglu"), n_group=entry.get("n_group"),
                   topk_group=entry.get("topk_group"),
                   routed_scaling_factor=float(entry.get("routed_scaling_factor", 1.0)),
                   bias=bool(entry.get("bias", False)),
                   quant=tuple(entry.get("quant", ("none",))))


MODELS: Dict[str, MoEShape] = {m.name: m for m in (
    MoEShape("qwen3_30b_a3b", 128, 2048, 768, 8, routing="renormalize_naive",
             quant=("none", "fp8")),
    MoEShape("mixtral_8x7b", 8, 4096, 14336, 2, quant=("none", "fp8")),
    MoEShape("deepseek_v3", 256, 7168, 2048, 8, routing="deepseek_v3", n_group=8, topk_group=4,
             routed_scaling_factor=2.5, quant=("fp8_block", "nvfp4")),
    MoEShape("gpt_oss_120b", 128, 2880, 2880, 4, activation="swiglu_oai", bias=True,
             quant=("mxfp4",)),
    MoEShape("llama4_scout", 16, 5120, 8192, 1, routing="llama4", quant=("none", "fp8")),
)}
