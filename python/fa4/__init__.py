"""fa4: exact, fast attention (FlashAttention) on NVIDIA GPUs and the CPU.

FlashAttention's functions, with its names and arguments:

- :func:`flash_attn_func` ``(q, k, v, ...)``: ``q`` is ``(batch, seqlen_q, heads_q, head_dim)``,
  ``k`` and ``v`` ``(batch, seqlen_k, heads_kv, head_dim[_v])``;
- :func:`flash_attn_varlen_func`: packed ``(total, heads, head_dim)`` tensors and ``cu_seqlens``;
- :func:`flash_attn_with_kvcache`: decode over a paged (or contiguous) KV cache, with an
  optional append of new keys and values.

Inputs may be torch tensors (CUDA: fa4's GPU kernels on torch's current stream, no copies; CPU:
fa4's CPU backend) or numpy arrays (the CPU backend). fp8 (e4m3) inputs take FlashAttention-3's
``q_descale``, ``k_descale``, ``v_descale`` (forward only; on the GPU, Hopper's kernel); fp8 KV
caches of :func:`flash_attn_with_kvcache` take ``k_scale`` and ``v_scale`` (vLLM's
``fp8_e4m3``). Gradients flow through ``torch.autograd`` (fa4's backward); the functions are
``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces them without
graph breaks.

fa4's own: :func:`plan` (FA4Config, the SM100 planner, as a dict), :func:`combine` (the exact
merge of split-KV partial results), :func:`flash_attn_backward` (the backward as a function),
:func:`build_info`, :func:`cuda_status`.
"""

import glob as _glob
import os as _os


def _find_nvrtc():
    """Points fa4 at NVRTC from pip's NVIDIA wheels (``nvidia-cuda-nvrtc``, which
    ``pip install fa4[cuda]`` and PyTorch's CUDA wheels bring), unless ``FA4_NVRTC_DIR`` is set;
    without either, fa4 looks on the loader's path (``LD_LIBRARY_PATH``, a CUDA toolkit)."""
    if _os.environ.get("FA4_NVRTC_DIR"):
        return
    try:
        import nvidia
    except ImportError:
        return
    for base in getattr(nvidia, "__path__", []):
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            if _glob.glob(_os.path.join(base, sub, "libnvrtc.so.*")):
                _os.environ["FA4_NVRTC_DIR"] = _os.path.join(base, sub)
                return


_find_nvrtc()

from ._interface import (  # noqa: E402
    build_info,
    combine,
    cuda_status,
    flash_attn_backward,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    plan,
)

__version__ = build_info()["version"]

__all__ = [
    "__version__",
    "build_info",
    "combine",
    "cuda_status",
    "flash_attn_backward",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "plan",
]
