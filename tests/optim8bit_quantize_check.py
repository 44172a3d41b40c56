"""The 8-bit AdamW kernel's quantizer (dtrain/lowp/optim8bit/triton_step.py: `_code_guess` from
the value, `_quantize` from the guess and the table) against torchao's binary search, also
with the guess moved one code either way (the GPU's log2 may do that; the interpreter's does
not), on every table value, the midpoints between neighbours (where rounding turns) and
decade edges, each with its 4 nearest fp32 neighbours on each side, on 0, +-1, beyond 1, inf
and NaN, and on random values spread over every decade: 1.2M values. Run as a script with
TRITON_INTERPRET=1 for the CPU test (tests/test_optim8bit.py); tests/gpu calls `mismatches`
on CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dtrain.lowp.optim8bit.triton_step import _code_guess, _quantize


@triton.jit
def _codes_kernel(x_ptr, out_ptr, qmap, n, off, SIGNED: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    codes = _quantize(x, qmap, _code_guess(x, SIGNED) + off)
    tl.store(out_ptr + offs, codes.to(tl.int32), mask=mask)


def _values(qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    turns = [qmap, (qmap[1:] + qmap[:-1]) / 2, torch.tensor([10.0**-k for k in range(9)])]
    out = [t.float() for t in turns]
    for t in turns:
        up, down = t.float(), t.float()
        for _ in range(4):
            up = torch.nextafter(up, torch.tensor(2.0))
            down = torch.nextafter(down, torch.tensor(-2.0))
            out += [up, down]
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp(torch.empty(200_000).uniform_(-20, 0.5, generator=gen))
    out += [spread, torch.rand(200_000, generator=gen)]
    out.append(torch.tensor([0.0, -0.0, 1.0, 1.5, 1e-30, float("inf"), float("nan")]))
    x = torch.cat(out)
    return torch.cat([x, -x]) if signed else x.abs()


def mismatches(device: torch.device) -> dict[tuple[bool, int], tuple[int, int]]:
    """{(signed, guess moved by): (values checked, codes unlike torchao's)} for exp_avg's and
    exp_avg_sq's maps."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    result = {}
    for signed in (True, False):
        qmap = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned())
        x = _values(qmap, signed)
        ref = quantize_8bit_with_qmap(x, qmap).int()
        qmap, x = qmap.to(device), x.to(device)
        for off in (-1, 0, 1):
            out = torch.empty(x.numel(), dtype=torch.int32, device=device)
            block = 4096
            _codes_kernel[(triton.cdiv(x.numel(), block),)](
                x, out, qmap, x.numel(), off, SIGNED=signed, B=block
            )
            result[signed, off] = (x.numel(), int((out.cpu() != ref).sum()))
    return result


if __name__ == "__main__":
    for (signed, off), (n, bad) in mismatches(torch.device("cpu")).items():
        print("RESULT", int(signed), off, n, bad)
