"""moeblaze for PyTorch: Mixture-of-Experts layers whose routing is indexing, not copying.

    import moeblaze
    moe = moeblaze.MoE(hidden_size=512, intermediate_size=256, num_experts=32, top_k=4,
                       device="cuda", dtype=torch.bfloat16)
    out, losses = moe(x)                      # x (..., 512)
    (loss_fn(out) + losses.total).backward()

docs/PYTORCH.md describes the design (C ABI + torch.library custom ops);
moeblaze.integrations.hf plugs it into Hugging Face transformers (experts_implementation).
"""
from . import ops
from ._ext import extension_status, use_extension
from ._lib import MoeblazeError, UnsupportedError, has_cuda, library_path, memory_stats, reset_peak
from .expert_parallel import (ExpertParallelMoE, ep_experts_from_routing, ep_moe_experts,
                              ep_shard)
from .layer import (Fp8WeightCache, MoE, RouterLosses, SharedExpert, TorchMoE,
                    experts_from_routing, moe_experts, router_losses)
from .reference import dense_reference, torch_experts, torch_router

__version__ = "0.1.0"

__all__ = ["MoE", "Fp8WeightCache", "TorchMoE", "SharedExpert", "RouterLosses", "moe_experts",
           "experts_from_routing", "router_losses", "ops", "memory_stats", "reset_peak",
           "has_cuda", "library_path", "MoeblazeError", "UnsupportedError", "dense_reference",
           "torch_experts", "torch_router", "ExpertParallelMoE", "ep_experts_from_routing",
           "ep_moe_experts", "ep_shard", "use_extension", "extension_status"]
