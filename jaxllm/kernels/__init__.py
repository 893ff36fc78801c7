"""Pallas (Triton) kernels for the GPU decode step, where XLA's own fusions cost too many launches:
one kernel family a module, each with a `supports(...)` of its hard limits. Which kernel, tile and
fusion a step takes is the step plan's choice (`jaxllm.model.plan`); the knobs are one
`KernelTuning` (`tuning`), read from the environment once. Figures: docs/decisions/.

- decode_attention: rotate + cache write + attention over each row's live slots (`SplitHeads`);
  `verify_attention`, the same for a few new tokens a row (a speculative verify step)
- project: one-row GEMV with norm / bias / residual / SwiGLU epilogues
- digits: int8 tensor-core products from a row's int8 digits (`DigitRow`, `down_bounds`)
- rows_project: 8-32-row tensor-core matrices with their epilogues
- add_norm: residual add + RMSNorm (+ the normed row's digits)
- route: MoE softmax + top-k
- probe: whether each family compiles here (the plan takes XLA's form where one does not)
"""

from jaxllm.kernels.add_norm import add_norm
from jaxllm.kernels.decode_attention import SplitHeads, decode_attention, verify_attention
from jaxllm.kernels.digits import DIGIT_ROWS, DIGITS, DOWN_DIGITS, DigitRow, down_bounds
from jaxllm.kernels.project import project
from jaxllm.kernels.route import pick_experts, route
from jaxllm.kernels.rows_project import rows_project
from jaxllm.kernels.tuning import MODES, TUNING, KernelTuning, current

__all__ = ["add_norm", "MODES", "SplitHeads", "decode_attention", "DIGIT_ROWS", "DIGITS", "DOWN_DIGITS",
           "DigitRow", "down_bounds", "project", "pick_experts", "route", "rows_project", "TUNING",
           "KernelTuning", "current", "verify_attention"]
