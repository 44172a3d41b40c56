"""What the int8 Triton and Gluon GEMMs share: autotuning's timer and whether TMA can read a
pair of operands (here so that neither kernel module imports the other)."""

from __future__ import annotations


def bench_or_skip(kernel_call, quantiles):
    """Autotuning's timer, shorter than Triton's default (25 + 100 ms a config), and a config
    that fails to compile is skipped (timed as infinite) rather than failing the run."""
    import triton

    try:
        return triton.testing.do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)
    except Exception as e:  # noqa: BLE001 - any compile failure of one config
        if "out of memory" in str(e) or "illegal" in str(e):
            raise
        return [float("inf")] * len(quantiles)


def median_ms(kernel_call) -> float:
    """kernel_call's median time with autotuning's timer (`bench_or_skip`: infinite where it
    fails to compile), for a choice among kernels made outside triton.autotune."""
    # autotuning's quantiles: with one, do_bench returns a bare float
    return bench_or_skip(kernel_call, [0.5, 0.2, 0.8])[0]


def tma_ok(a, b) -> bool:
    """TMA can read both operands: a row-major, b column-major, 16-byte-aligned bases and rows."""
    bt = b.t()
    return (
        a.stride(1) == 1
        and bt.stride(1) == 1
        and a.stride(0) % 16 == 0
        and bt.stride(0) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
    )
