"""The tolerances every layout's training is held to against the single-process reference, and the
steps it runs (why these values: tests/workers/test_workers_numerics.py's docstring, and below)."""

RTOL = 1e-5
# bf16 mixed precision (options.cpu_bf16: the GPU path on CPU ranks) against the fp32 reference:
# bf16 rounds each activation/weight copy by up to 2^-9 = 2e-3 relative; the loss averages
# 512 tokens' errors, measured <= 9.2e-5 (2026-11). 2e-3 is one bf16 rounding step: it catches a wrong
# cast (>= 1e-2 on the loss) without pretending bf16 is fp32.
BF16_RTOL = 2e-3
# A wrong gradient scale hardly moves the loss under Adam (see above), so the bf16 gradient norm is
# compared too: bf16 gradients (fp32 reduce) measured <= 1.5e-3 from the fp32 norm over 4 steps;
# 2e-2 leaves >10x headroom and still catches any wrong 1/m, 1/dp or 1/tp factor (>= 2x).
BF16_NORM_RTOL = 2e-2
STEPS = 4
