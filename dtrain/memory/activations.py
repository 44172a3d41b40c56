"""Activations saved for backward, and the loss's transients, per micro-batch."""

from __future__ import annotations

from dtrain.memory.setup import MemorySetup
from dtrain.model import ModelConfig


def uses_autocast(setup: MemorySetup) -> bool:
    """Mixed precision through autocast, which casts every matmul's inputs; a strategy whose
    wrapper hands the module weights already in the compute dtype keeps each activation once."""
    return setup.precision.mixed and setup.facts.autocast


def quantized_inputs(setup: MemorySetup) -> str:
    """'int8' or 'fp8' where the blocks' linears are swapped for quantized ones whose saved
    inputs differ from F.linear's (dtrain/lowp/int8/linear.py, torchao Float8Linear); else ''.

    int8-torchao saves its inputs in the compute dtype, as F.linear does: ''."""
    q = getattr(setup.precision, "quantize", "")
    return q if q in ("int8", "fp8") else ""


def layer_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Bytes one transformer block saves for backward, for one micro-batch: dtrain/model.py's
    block counted tensor by tensor, eager or compiled, plain or with quantized linears
    (docs/memory.md, "The activation count, term by term"). Tests check it against the tensors
    autograd saves on CPU, eager and (slow) compiled.
    """
    pr = setup.precision
    c = pr.compute_dtype.itemsize
    mixed = uses_autocast(setup)
    quant = quantized_inputs(setup)
    b, s, h, f = setup.micro_batch_size, setup.seq_len, cfg.d_model, cfg.ffn_hidden
    bs, sbh, bsf = b * s, b * s * h, b * s * f
    kv = b * s * cfg.n_kv_head * cfg.head_dim
    lse = 4 * b * cfg.n_head * s
    # The residual stream has the embedding's dtype: the stored one under autocast (which
    # leaves embeddings alone), the compute dtype where the module computes in it natively.
    r = pr.param_dtype.itemsize if setup.facts.autocast else c
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

    Only where autocast does the casting, and not compiled (inductor recomputes the casts).
    The blocks' int8 and fp8 linears hand autocast no weight to cast (their matmuls are not
    F.linear): only the output layer's is cached."""
    pr = setup.precision
    if not uses_autocast(setup) or setup.compile:
        return 0
    d, hd = cfg.d_model, cfg.head_dim
    per_layer = 2 * d * cfg.n_head * hd + 2 * d * cfg.n_kv_head * hd + 3 * d * cfg.ffn_hidden
    if quantized_inputs(setup):
        per_layer = 0
    return pr.compute_dtype.itemsize * (cfg.n_layer * per_layer + cfg.vocab_size * d)


def head_activation_bytes(cfg: ModelConfig, setup: MemorySetup) -> int:
    """Embedding + final norm + output layer + loss, saved for backward: the token ids and
    targets (int64), the norm's fp32 input and rstd (and x·rstd off CUDA), the output layer's
    input and the fp32 log-softmax over the vocabulary (compiled: the logits in c bytes)."""
    c = setup.precision.compute_dtype.itemsize
    bs = setup.micro_batch_size * setup.seq_len
    bsd = bs * cfg.d_model
    ids = 2 * 8 * bs
    norm = 4 * bsd + 4 * bs + (0 if setup.device == "cuda" or setup.compile else 4 * bsd)
    if not setup.facts.autocast and c < 4 and not setup.compile:
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
    writes the gradient w.r.t. the logits in their own dtype: c bytes per logit (read off
    Inductor's generated code; docs/memory.md)."""
    c = setup.precision.compute_dtype.itemsize
    mixed = setup.precision.mixed
    logits = setup.micro_batch_size * setup.seq_len * cfg.vocab_size
    if setup.compile:
        return c * logits
    return max(8, c + (4 if mixed else 0)) * logits
