"""bench/trace_summary.py --waits on a crafted trace: the compute stream's gaps by cause, the
host's syncs with the operator they ran under, and the launch lag."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from trace_summary import host, host_markdown, waits, waits_markdown  # noqa: E402


def kernel(tid, ts, dur, name, corr):
    return {
        "cat": "kernel",
        "ph": "X",
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "name": name,
        "args": {"correlation": corr},
    }


def runtime(ts, dur, name, corr=None, tid=1):
    args = {} if corr is None else {"correlation": corr}
    return {
        "cat": "cuda_runtime",
        "ph": "X",
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "name": name,
        "args": args,
    }


def test_gaps_are_put_down_to_what_ended_them_and_syncs_to_their_operator():
    events = [
        kernel(7, 0, 1000, "nvjet_gemm_a", 1),
        kernel(7, 2000, 1000, "split_with_sizes_copy_out", 2),  # waited 1 ms for the gather
        kernel(7, 3500, 500, "triton_poi_fused", 3),  # 0.5 ms: nothing ended, launched late
        kernel(7, 4000, 100, "triton_poi_fused", 4),  # no gap
        kernel(22, 500, 1480, "ncclDevKernel_AllGather_RING_LL", 5),  # ends 20 us before
        runtime(-10, 5, "cudaLaunchKernel", 1),
        runtime(1990, 5, "cudaLaunchKernel", 2),
        runtime(3490, 5, "cudaLaunchKernel", 3),
        runtime(100, 5, "cudaLaunchKernel", 4),
        runtime(400, 5, "cudaLaunchKernel", 5),
        {"cat": "cpu_op", "ph": "X", "tid": 1, "ts": 90, "dur": 1600, "name": "aten::to"},
        {"cat": "cpu_op", "ph": "X", "tid": 1, "ts": 95, "dur": 1550, "name": "aten::copy_"},
        runtime(100, 1500, "cudaStreamSynchronize"),
        runtime(3000, 10, "cudaStreamSynchronize"),  # too short to list
    ]
    w = waits(events, steps=1)
    gather = "nccl: ncclDevKernel_AllGather_RING_LL"
    assert w["gaps_ms"] == pytest.approx({gather: 1.0, "the host (launched late)": 0.5})
    assert w["gap_counts"] == {gather: 1, "the host (launched late)": 1}
    assert w["syncs"] == [(0.1, 1.5, "cudaStreamSynchronize", "aten::to")]
    # ten slices of the 4.1 ms window: kernel 1 (lag 10 us) in the first, kernel 2 (10 us) in
    # the fifth, kernel 3 (10 us) in the ninth, kernel 4 (3.9 ms) in the last
    lag = w["lag_ms_by_tenth"]
    assert lag[0] == pytest.approx(0.01) and lag[-1] == pytest.approx(3.9)
    assert lag[1] is None
    md = waits_markdown(w, steps=1)
    assert "1.5 ms per step" in md and "| 0.1 | 1.5 | cudaStreamSynchronize | aten::to |" in md


def test_host_time_is_the_union_of_each_threads_events_with_names_by_inclusive_time():
    def op(tid, ts, dur, name, cat="cpu_op"):
        return {"cat": cat, "ph": "X", "tid": tid, "ts": ts, "dur": dur, "name": name}

    events = [
        op(1, 0, 5000, "ProfilerStep#3", "user_annotation"),  # the whole step: not busy time
        op(1, 0, 4900, "train.py(80): one_step", "python_function"),  # a frame: named, not busy
        op(1, 0, 1000, "FSDP::pre_forward", "user_annotation"),
        op(1, 100, 400, "FSDP::all_gather", "user_annotation"),  # nested: adds no busy time
        op(1, 900, 300, "Torch-Compiled Region", "user_annotation"),  # overlaps by 100 us
        op(1, 2000, 600, "FSDP::pre_forward", "user_annotation"),
        op(2, 0, 200, "aten::mm"),  # autograd's thread, less busy
        kernel(7, 0, 5000, "nvjet_gemm_a", 1),  # not host time
    ]
    threads = host(events, steps=2)
    assert [t["tid"] for t in threads] == [1, 2]
    assert threads[0]["busy_ms"] == pytest.approx((1200 + 600) / 1e3 / 2)
    names = {n: (ms, c) for n, ms, c in threads[0]["names"]}
    assert names["FSDP::pre_forward"] == pytest.approx((0.8, 1.0))
    assert names["FSDP::all_gather"] == pytest.approx((0.2, 0.5))
    assert "ProfilerStep#3" not in names
    assert names["train.py(80): one_step"] == pytest.approx((2.45, 0.5))
    md = host_markdown(threads, top=5)
    assert "Host thread 1: busy 0.9 ms per step" in md and "| `FSDP::pre_forward` | 0.8 | 1 |" in md


def test_kinds_count_dtrain_int8_gemms_as_matmuls():
    """The Triton int8 GEMMs are matmuls; Inductor's quantize kernels named after the op whose
    input they produce stay Inductor's."""
    from trace_summary import kind

    assert kind("_int8_mm_tma_kernel") == "matmul"
    assert kind("_int8_mm_kernel") == "matmul"
    name = "triton_red_fused__to_copy_abs_amax_clamp_clamp_min_clone_div_int8_mm_mul_round_silu_t"
    assert kind(name) == "inductor (fused)"
    assert kind("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul"
