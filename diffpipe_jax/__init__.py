"""diffpipe-jax: LoRA training of diffusion transformers (FLUX.1, LTX-Video, HunyuanVideo) in JAX."""
import os

# Triton GEMMs off, so every matmul goes to cuBLAS(Lt). With them on, XLA autotuned each float8
# GEMM for ~20 s and fused in slow transposes (FLUX fp8 step 0.474 s, compile 188 s; off:
# 0.450 s, 41 s); bf16 steps are unchanged (benchmarks/HISTORY.md, "Flux LoRA step: float8
# matmuls for the fp8 base"). XLA reads XLA_FLAGS when jax starts
# its backend, hence on import; a value the user sets there is kept.
if "xla_gpu_enable_triton_gemm" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      filter(None, [os.environ.get("XLA_FLAGS"), "--xla_gpu_enable_triton_gemm=false"]))
