"""Activations saved for backward, and the loss's transients, per micro-batch."""

from __future__ import annotations

from dtrain.memory.setup import MemorySetup
from dtrain.memory.state import _itemsize
from dtrain.model import ModelConfig


def uses_autocast(setup: MemorySetup) -> bool:
    """Mixed precision through autocast (single, DDP), which casts every matmul's inputs.

    FSDP's MixedPrecisionPolicy and DeepSpeed instead hand the module parameters already in
    the compute dtype, so activations are born in it and each one is kept once."""
    pr = setup.precision
    return pr.compute_dtype != pr.param_dtype and setup.strategy in ("single", "ddp")


def quantized_inputs(setup: MemorySetup) -> str:
    """'int8' or 'fp8' where the blocks' linears are swapped for quantized ones whose saved
    inputs differ from F.linear's (dtrain/lowp/int8.py, torchao Float8Linear); else ''.

    int8-torchao saves its inputs in the compute dtype, as F.linear does: ''."""
    q = getattr(setup.precision, "quantize", "")
    return q if q in ("int8", "fp8") else ""


def layer_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Bytes one transformer block saves for backward, for one micro-batch.

    Eager (what dtrain/model.py does, tensor by tensor; a test checks this count against
    the tensors autograd really saves, on CPU, for fp32, bf16 and int8 under autocast and for
    bf16, int8 and fp8 computing natively in bf16 as under FSDP), with c = compute bytes,
    sbh = micro_batch · seq · d_model, bs = micro_batch · seq, f = ffn_hidden:
      each RMSNorm upcasts its input and keeps it in fp32 (4·sbh) with rstd (4·b·s); the
      composite CPU kernel also keeps x·rstd (4·sbh), CUDA's fused kernel does not; a gain
      stored in fewer than 4 bytes is upcast too, and that fp32 copy (4·h) is kept;
      wq, wk, wv keep their inputs: under autocast each casts the norm's output separately
      (3·c·sbh), in one dtype they share it (1·c·sbh); the same for w1, w3 (2 or 1);
      SDPA keeps q, k, v (k, v repeated to every head under GQA), its output and the fp32
      log-sum-exp (b·heads·s): no s x s scores, so Korthikanti's 5as/h term is gone; wo reads
      SDPA's output through a view on CUDA (flash's output is laid out (B, T, H, D)), a copy
      on CPU;
      SwiGLU keeps w1's output, silu's output, w3's output, and w2 its input (the product):
      4·c·b·s·f.
    int8 eager (dtrain/lowp/int8.py): each of the seven linears quantizes its own input and
      saves only that int8 copy (1 byte an element) and its fp32 per-token scales (4·b·s), so
      the five norm-fed linears keep 5·(sbh + 4·bs) in every setting, wo sbh + 4·bs instead
      of its input, w2 b·s·f + 4·bs instead of the c-byte product; the weights are the
      parameters themselves, so autocast caches no copy of them (`autocast_weight_bytes`).
    fp8 eager (torchao's Float8Linear): `matmul_with_hp_or_float8_args` saves its input and
      weight in high precision and casts them to fp8 again in backward, so the block saves what
      bf16 saves; under autocast Float8Linear casts its input to the autocast dtype itself
      (on CUDA: torch.is_autocast_enabled() is CUDA's), while the weight reaches the fp8 cast
      uncast: no autocast weight cache for the blocks either.
    Compiled (inductor's min-cut partitioner, per block; checked tensor by tensor against the
    saved tensors of a compiled block on CPU, tests/test_memory.py, marked slow): each norm
    keeps its input in the residual dtype and rstd; SDPA keeps q, out, un-repeated k, v and
    the log-sum-exp; SwiGLU keeps w1's and w3's outputs. What a matmul's backward reads is
    materialised in forward and saved, since recomputing it would not fuse into the matmul:
    the c-cast outputs of the two norms (shared by wq, wk, wv and by w1, w3, after CSE), wo's
    contiguous input and w2's input (the product): 3·c·sbh + c·b·s·f.
    Compiled, quantized: none of those matmul inputs is saved. The quantized operand is a
    pointwise function of tensors saved anyway (the norm's input and rstd, SDPA's output, w1's
    and w3's outputs) and of its scale, so the partitioner recomputes it in backward; only the
    scales, reductions it will not recompute, are saved: int8 one fp32 scale per token for
    each of the four distinct inputs (4 x 4·bs); fp8 tensorwise one 0-d amax (c bytes) per
    linear; fp8 rowwise nothing (its row-wise scales are recomputed with the casts).
    This matches the GPU (model=1b, fsdp x2, micro-batch 8 x 2048, compiled blocks, H200):
    measured peak allocated bf16 minus int8 is 8.619 GiB per rank, and 24 layers x
    (3·c·sbh + c·b·s·f - 4 x 4·bs) is 8.619 GiB. The plans for those runs (plan_memory, rank 0,
    vocab 50304) are +2.0% (bf16), -3.0% (int8) and -2.7% (fp8) off the measured peak reserved
    (42.82, 35.24, 35.01 GiB); no constant was fitted to them.
    """
    pr = setup.precision
    c = _itemsize(pr.compute_dtype)
    mixed = uses_autocast(setup)
    quant = quantized_inputs(setup)
    b, s, h, f = setup.micro_batch_size, setup.seq_len, cfg.d_model, cfg.ffn_hidden
    bs, sbh, bsf = b * s, b * s * h, b * s * f
    kv = b * s * cfg.n_kv_head * cfg.head_dim
    lse = 4 * b * cfg.n_head * s
    # The residual stream has the embedding's dtype: the stored one under autocast (which
    # leaves embeddings alone), the compute dtype where the module computes in it natively.
    native = setup.strategy not in ("single", "ddp")
    r = c if native else _itemsize(pr.param_dtype)
    resid = r * sbh
    if setup.activation_checkpointing == "full":
        return resid  # only the block's input; the rest is recomputed in backward
    if setup.activation_checkpointing == "selective":
        # torchtitan's op-level policy: keep matmul and attention outputs, recompute the rest.
        mm_out = c * (sbh + 2 * kv) + c * sbh + 2 * c * b * s * f + c * sbh  # q,k,v wo w1,w3 w2
        return resid + mm_out + c * sbh + lse  # + block input, SDPA out, lse
    if setup.compile:
        norms = 2 * (resid + 4 * bs)  # each norm's input (the residual) and rstd
        attn = c * sbh + 2 * c * kv + c * sbh + lse
        mlp = 2 * c * bsf
        if quant == "int8":
            mm_inputs = 4 * 4 * bs  # per-token scales of qkv's, wo's, w1/w3's, w2's input
        elif quant == "fp8" and getattr(pr, "fp8_recipe", "tensorwise") == "rowwise":
            mm_inputs = 0  # the row-wise scales are recomputed with the casts
        elif quant == "fp8":
            mm_inputs = 7 * c  # one 0-d amax per linear, in the input's dtype
        else:
            mm_inputs = 2 * c * sbh + c * sbh + c * bsf
        return norms + attn + mlp + mm_inputs
    fused_norm = setup.device == "cuda"
    gain = 4 * h if r < 4 else 0  # RMSNorm's weight.float(): a copy where the gain is narrower
    norms = 2 * (4 * sbh + 4 * bs + (0 if fused_norm else 4 * sbh) + gain)
    attn = 4 * c * sbh + lse
    mlp = 3 * c * bsf
    if quant == "int8":
        linear_inputs = 6 * (sbh + 4 * bs) + bsf + 4 * bs  # int8 copies + per-token scales
    else:
        linear_inputs = (3 + 2) * c * sbh if mixed else 2 * c * sbh
        linear_inputs += (0 if setup.device == "cuda" else c * sbh) + c * bsf  # wo's, w2's
    return norms + attn + mlp + linear_inputs


def autocast_weight_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Autocast's cached casts of the weight matrices (c bytes each), kept for backward.

    Only where autocast does the casting (single, DDP); FSDP all-gathers in the compute dtype
    and DeepSpeed casts the module itself. Inductor recomputes the casts in backward. The
    blocks' int8 and fp8 linears hand autocast no weight to cast (their matmuls are not F.linear):
    only the output layer's is cached."""
    pr = setup.precision
    if not uses_autocast(setup) or setup.compile:
        return 0
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd + 3 * d * cfg.ffn_hidden
    if quantized_inputs(setup):
        per_layer = 0
    return _itemsize(pr.compute_dtype) * (cfg.n_layer * per_layer + cfg.vocab_size * d)


def head_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Embedding + final norm + output layer + loss, saved for backward: the token ids and
    targets (int64), the norm's fp32 input and rstd (and x·rstd off CUDA), the output layer's
    input and the fp32 log-softmax over the vocabulary (compiled: the logits in c bytes)."""
    c = _itemsize(setup.precision.compute_dtype)
    bs = setup.micro_batch_size * setup.seq_len
    bsd = bs * cfg.d_model
    ids = 2 * 8 * bs
    norm = 4 * bsd + 4 * bs + (0 if setup.device == "cuda" or setup.compile else 4 * bsd)
    native = setup.strategy not in ("single", "ddp")
    if native and c < 4 and not setup.compile:
        norm += 4 * cfg.d_model  # the fp32 copy of a c-byte gain (see layer_activation_bytes)
    out_in = c * bsd
    # Eager: nll_loss also keeps its 0-d fp32 total weight.
    loss = (c * bs * cfg.vocab_size + 4 * bs) if setup.compile else 4 * bs * cfg.vocab_size + 4
    return ids + norm + out_in + loss


def loss_transient_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Extra bytes at the start of backward: the loss's gradient w.r.t. the fp32 log-softmax
    and w.r.t. its input (eager: 2 x 4 bytes per logit; the c-bytes logits cast back after); in
    the forward, the c-bytes logits and their fp32 copy were alive at once.

    Compiled (dtrain.model.lm_loss under torch.compile), the backward is one fused kernel that
    writes the gradient w.r.t. the logits in their own dtype from the saved logits and one
    logsumexp per token: c bytes per logit. Checked in Inductor's generated code for bf16
    logits (its backward allocates one bf16 buffer of the logits' shape and a row vector), and
    against the GPU: with this term the 1b fsdp plan before allocator slack is within 1% of the
    measured peak allocated for bf16 and int8 (2x H200, docs/benchmarks.md)."""
    c = _itemsize(setup.precision.compute_dtype)
    mixed = setup.precision.compute_dtype != setup.precision.param_dtype
    logits = setup.micro_batch_size * setup.seq_len * cfg.vocab_size
    if setup.compile:
        return c * logits
    return max(8, c + (4 if mixed else 0)) * logits
