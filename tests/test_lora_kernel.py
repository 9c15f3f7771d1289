"""The CPU kernel of LoRA deltas (kernels/csrc/lora_delta.cpp) against the plain-PyTorch path of the same
LoRALinear: float32 and bfloat16 rows, one and several segments, parts a slot leaves alone, rows on the
base model, ranks and widths that are no multiple of the kernel's blocks."""

from __future__ import annotations

import pytest
import torch

from tokenmill.lora.layer import LoRALinear, StepSegments


class _Zero(torch.nn.Module):
    """A base linear whose output is a fixed tensor: the delta is then all that differs."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linspace(-1, 1, x.shape[0] * self.out_features).view(x.shape[0], -1).to(x.dtype)


def _kernel():
    from tokenmill.kernels import cpu_kernels

    try:
        return cpu_kernels().lora_delta_
    except Exception as e:  # noqa: BLE001 - no compiler here: the kernel cannot be checked
        pytest.skip(f"the CPU kernels do not build here: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("k", "parts", "rank"),
    [(64, [(0, 64), (64, 96), (96, 128)], 16), (72, [(0, 40)], 12), (48, [(0, 100), (100, 200)], 4)],
)
def test_kernel_matches_the_torch_path(dtype: torch.dtype, k: int, parts: list, rank: int) -> None:
    kernel = _kernel()
    base = _Zero(k, parts[-1][1])
    g = torch.Generator().manual_seed(0)
    made = []
    for kern in (None, kernel):
        step = StepSegments()
        w = LoRALinear(base, parts, 3, rank, dtype, torch.device("cpu"), step, kern)
        g.manual_seed(1)
        for slot in range(3):
            deltas = [
                (
                    torch.randn(rank - slot, k, generator=g),
                    torch.randn(hi - lo, rank - slot, generator=g),
                    0.5,
                )
                if (slot + i) % 3 != 2  # some parts left alone by some slots
                else None
                for i, (lo, hi) in enumerate(parts)
            ]
            w.set_slot(slot, deltas)
        made.append((w, step))
    x = torch.randn(11, k, generator=g).to(dtype)
    for segments in ([(0, 11, 1)], [(0, 3, 0), (3, 4, 2), (6, 11, 1)], [(2, 2, 0)]):
        outs = []
        for w, step in made:
            step.set(segments)
            outs.append(w(x).float())
        plain, fast = outs
        # The kernel sums in float32 over float32 A and B; the plain path in the rows' dtype.
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert (plain - fast).abs().max() <= tol * plain.abs().max(), segments
        untouched = [t for t in range(11) if not any(s <= t < e for s, e, _ in segments)]
        assert torch.equal(fast[untouched], base(x).float()[untouched])
