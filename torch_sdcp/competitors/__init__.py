"""The strongest public alternatives to torch_sdcp's boundaries, for the
benchmark, each on torch.distributed._symmetric_memory (CUDA only; importable
anywhere, the CUDA parts load on first use). NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1); no multimem instruction is used.

- ``SymmMemOutputLSE`` ("symm-mem", symm_mem.py): copies into the peers'
  inboxes between two barriers, then the local combine.
- ``VllmA2AOutputLSE`` ("vLLM a2a", vllm_a2a.py): vLLM's direct all-to-all
  for the Output/LSE boundary.
- ``FlashInferFusedCombine`` ("FlashInfer fused", flashinfer_combine.py):
  FlashInfer's fused exchange + merge (``decode_cp_a2a_lse_reduce``), one
  kernel, in Triton.
- ``VllmDirectTopK`` ("vLLM direct", vllm_direct_topk.py): vLLM 0.34.0's
  peer-memory top-K merge (``DirectDCPTopKWorkspace``), with torch_sdcp's
  ``topk_select`` for the selection.

Benchmark-only: modules for comparisons, not part of the torch_sdcp API.
"""

from torch_sdcp.competitors.flashinfer_combine import FlashInferFusedCombine
from torch_sdcp.competitors.symm_mem import SymmMemOutputLSE
from torch_sdcp.competitors.vllm_a2a import VllmA2AOutputLSE
from torch_sdcp.competitors.vllm_direct_topk import VllmDirectTopK

__all__ = ["FlashInferFusedCombine", "SymmMemOutputLSE", "VllmA2AOutputLSE", "VllmDirectTopK"]
