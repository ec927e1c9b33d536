"""Native CPU kernels: C sources in engine/kernels/csrc, compiled at first use, called through ctypes.

`load()` compiles engine/kernels/csrc/*.c once per source, compiler and CPU into the cache
directory (`$XDG_CACHE_HOME/splitserve/kernels`, the file named by their hash, so a
cache shared between machines never runs code built for another CPU) and returns the
kernels, or None with the reason logged once when there is no C compiler or the build
fails: callers then keep their torch path. The library links libgomp, so its parallel
regions run on the OpenMP pool torch already loaded (one pool, no oversubscription).

Data crosses as raw pointers: the caller checks dtypes, devices and contiguity (the
`paged_attention` wrapper does), the C side trusts them.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine.model.model_config import MoEConfig
from engine.model.moe import MoEWeights, moe_forward

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in (
    "paged_attention.c", "rms_norm.c", "linear.c", "pointwise.c", "copy.c", "forward.c")]
HEADERS = [CSRC / name for name in ("bf16.h", "fastmath.h", "kernels.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
BUILD_TIMEOUT_S = 120.0

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _AttnArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_queries", "num_heads", "num_kv_heads", "head_dim", "block_size", "q_token_stride",
        "out_token_stride", "block_stride", "layer_offset", "v_offset", "table_stride", "table_rows", "num_blocks",
        "num_tokens",
    )] + [("scale", ctypes.c_float), ("num_threads", ctypes.c_int32), ("window", ctypes.c_int64),
          ("softcap", ctypes.c_float), ("v_scale", ctypes.c_float)]


_LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
                 "down_bias")


class NativeLayer(ctypes.Structure):
    """One decoder layer's weight pointers for `decode_layers` (forward.c's layer_weights)."""
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _ForwardArgs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in
                 ("num_layers", "tokens", "hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [("eps", ctypes.c_float), ("num_threads", ctypes.c_int32), ("cos", ctypes.c_void_p),
                   ("sin", ctypes.c_void_p), ("rope_stride", ctypes.c_int64), ("pool", ctypes.c_void_p),
                   ("layer_stride", ctypes.c_int64)]
                + [(name, ctypes.c_void_p) for name in ("slot_blocks", "slot_offsets", "table", "token_index", "rows",
                                                        "ctx_lens", "x", "qkv", "attn", "act", "after")]
                + [("after_n", ctypes.c_int64), ("after_k", ctypes.c_int64)])


class NativeKernels:
    """The compiled library; one method per kernel."""

    reads_fp8_kv = True
    """`paged_attention` reads an e4m3 pool (its layer's scales given)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self._attn = _bind(lib, "paged_attention", [ctypes.POINTER(_AttnArgs)] + [ptr] * 7, ctypes.c_int)
        self._attn_e4m3 = _bind(lib, "paged_attention_e4m3", [ctypes.POINTER(_AttnArgs)] + [ptr] * 7, ctypes.c_int)
        """Over an e4m3 pool, by q's dtype."""
        self._norm = _bind(lib, "add_rms_norm", [ptr] * 4 + [i64, i64, ctypes.c_float, i32], None)
        self._silu_mul = _bind(lib, "silu_mul", [ptr, i64, i64, ptr, i32], None)
        self._rotary = _bind(lib, "rotary_store", [ptr] + [i64] * 5 + [ptr] * 2 + [i64] + [ptr] + [i64] * 5
                             + [ptr] * 2 + [i32], ctypes.c_int)
        linear_args = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, ptr, i64, i64]
        self._linear = {swiglu: _bind(lib, name, linear_args, ctypes.c_int, {torch.bfloat16: "bf16"})[torch.bfloat16]
                        for swiglu, name in ((False, "linear"), (True, "linear_swiglu"))}
        self.has_linear = bool(lib.linear_bf16_available())
        """Whether this CPU runs the bfloat16 linear kernel (AVX-512 BF16); else oneDNN stays."""
        self.copy_stream = lib.copy_stream
        """copy_stream(dst address, src address, nbytes): memcpy with non-temporal stores,
        for bytes this process won't read back (kvfabric's shm pushes); releases the GIL."""
        self.copy_stream.argtypes, self.copy_stream.restype = [ptr, ptr, i64], None
        self._layers = lib.decode_layers_bf16
        self._layers.argtypes = [ctypes.POINTER(_ForwardArgs), ctypes.POINTER(NativeLayer),
                                 ctypes.POINTER(_AttnArgs), ptr, ptr]
        self._layers.restype = ctypes.c_int

    def supports(self, dtype: torch.dtype, device: torch.device | str) -> bool:
        return dtype in self._attn and torch.device(device).type == "cpu"

    def paged_attention(
        self, q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor,
        token_index: torch.Tensor, rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float, out: torch.Tensor,
        window: int = 0, softcap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """Writes out[token_index[i]] = attention of q[token_index[i]] over keys 0 .. ctx_lens[i] - 1
        of block-table row rows[i], for one layer of the pool; with a `window` (a sliding window
        of keys), over the last `window` of them only; with a `softcap`, each score s becomes
        softcap * tanh(s / softcap) before the softmax.

        q, out: [num_tokens, heads, head_dim], heads and head_dim dense (tokens may be
        strided); pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
        contiguous; block_table: [batch, max_blocks] int64 contiguous; token_index, rows,
        ctx_lens: [n] int64 contiguous. Indices are range-checked in C before any work
        (ValueError); every ctx_len must be in 1 .. max_blocks * block_size. An e4m3 pool (FP8
        KV) holds K / k_scale and V / v_scale (engine/model/kv_pool.py).
        """
        fp8 = pool.dtype == torch.float8_e4m3fn
        args = _attention_args(q, pool, layer, block_table, token_index, rows, ctx_lens, scale * k_scale, out)
        args.window, args.softcap, args.v_scale = window, softcap, v_scale
        ptrs = [q, pool, block_table, token_index, rows, ctx_lens, out]
        status = (self._attn_e4m3 if fp8 else self._attn)[q.dtype](ctypes.byref(args), *(t.data_ptr() for t in ptrs))
        if status == -3:
            raise ValueError("paged_attention: a context length, block-table row, token or block id is out of range")
        if status == -2:
            raise ValueError(f"paged_attention: head_dim {q.shape[2]} is over the kernel's 512")
        if status != 0:
            raise MemoryError("paged_attention: no memory for the score scratch")

    def add_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    ) -> torch.Tensor:
        """h += residual (in place, when given), then returns RMSNorm(h) * weight.

        h, residual: [rows, dim] contiguous; weight: [dim]; all of one dtype.
        """
        rows, dim = h.shape
        for name, t in (("h", h), ("residual", residual), ("weight", weight)):
            if t is not None and (not t.is_contiguous() or t.dtype != h.dtype or t.shape[-1] != dim):
                raise ValueError(f"{name} must be contiguous {h.dtype} [..., {dim}], got {t.dtype} {tuple(t.shape)}")
        if residual is not None and residual.shape != h.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match h {tuple(h.shape)}")
        out = torch.empty_like(h)
        self._norm[h.dtype](h.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), rows, dim, eps, torch.get_num_threads())
        return out

    def moe(self, x: torch.Tensor, weights: MoEWeights, config: MoEConfig) -> torch.Tensor:
        """A mixture-of-experts MLP: no native kernel, the torch form (engine/model/moe.py)."""
        return moe_forward(x, weights, config)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] of shape [rows, 2 I]; returns [rows, I]."""
        rows, two_i = gate_up.shape
        if not gate_up.is_contiguous() or two_i % 2 or gate_up.dtype not in self._silu_mul:
            raise ValueError(f"gate_up must be contiguous [rows, 2 I] float32 or bfloat16, got "
                             f"{gate_up.dtype} {tuple(gate_up.shape)} strides {gate_up.stride()}")
        out = gate_up.new_empty(rows, two_i // 2)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), rows, two_i // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def rotary_store(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
        pool: torch.Tensor, layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
    ) -> None:
        """Rotates q and k in place in qkv [tokens, (heads + 2 kv_heads) head_dim] (rows may be
        strided) as engine/model/rope.py's apply_rotary does, then stores each token's k and v in
        pool[slot_blocks[t], layer, :, slot_offsets[t]]. cos, signed_sin: [tokens, 1, head_dim]."""
        tokens = qkv.shape[0]
        nb, _, _, bs, _, d = pool.shape
        if qkv.dtype not in self._rotary:
            raise ValueError(f"rotary_store takes float32 or bfloat16, got {qkv.dtype}")
        _check_rotary(qkv, heads, kv_heads, cos, signed_sin, pool, layer, slot_blocks, slot_offsets)
        status = self._rotary[qkv.dtype](
            qkv.data_ptr(), tokens, qkv.stride(0), heads, kv_heads, d, cos.data_ptr(), signed_sin.data_ptr(),
            cos.stride(0), pool.data_ptr(), nb, bs, pool.stride(0), layer * pool.stride(1), pool.stride(2),
            slot_blocks.data_ptr(), slot_offsets.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise ValueError("rotary_store: a slot's block id or offset is out of range")

    def decode_layers(
        self, weights: ctypes.Array, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
        pool: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, block_table: torch.Tensor,
        rows: torch.Tensor, ctx_lens: torch.Tensor, shape: tuple[int, int, int], eps: float, scale: float,
        after: torch.Tensor | None,
    ) -> torch.Tensor:
        """All decoder layers of a bfloat16 step whose tokens are one decode group in batch
        order (forward.c, the same kernels as the model's layer loop, bit for bit). h
        [tokens, hidden] (the residual stream) is added to in place; returns the last
        layer's MLP output. weights: one `NativeLayer` per layer, linears in `pack_linear`
        tiles; shape: (heads, kv_heads, intermediate size); after: the tiles of the linear
        the caller runs next. Arguments are checked as `rotary_store` and `paged_attention`
        check theirs; the kernels range-check indices before writing (ValueError)."""
        n, hidden = h.shape
        heads, kv_heads, inter = shape
        d = pool.shape[-1]
        if h.dtype != torch.bfloat16 or not h.is_contiguous():
            raise ValueError(f"h must be contiguous bfloat16 [tokens, hidden], got {h.dtype} {tuple(h.shape)}")
        new = lambda *size: h.new_empty(size)  # noqa: E731
        x, qkv, attn = new(n, hidden), new(n, (heads + 2 * kv_heads) * d), new(n, heads, d)
        act, delta = new(n, inter), new(n, hidden)
        _check_rotary(qkv, heads, kv_heads, cos, signed_sin, pool, 0, slot_blocks, slot_offsets)
        token_index = torch.arange(n)
        q = qkv[:, : heads * d].view(n, heads, d)
        attn_args = _attention_args(q, pool, 0, block_table, token_index, rows, ctx_lens, scale, attn)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        args = _ForwardArgs(
            num_layers=len(weights), tokens=n, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=d, inter=inter,
            eps=eps, num_threads=torch.get_num_threads(), cos=ptr(cos), sin=ptr(signed_sin),
            rope_stride=cos.stride(0), pool=ptr(pool), layer_stride=pool.stride(1), slot_blocks=ptr(slot_blocks),
            slot_offsets=ptr(slot_offsets), table=ptr(block_table), token_index=ptr(token_index), rows=ptr(rows),
            ctx_lens=ptr(ctx_lens), x=ptr(x), qkv=ptr(qkv), attn=ptr(attn), act=ptr(act),
            after=ptr(after), after_n=0 if after is None else after.shape[0] * 16,
            after_k=0 if after is None else after.shape[1] * 2,
        )
        status = self._layers(ctypes.byref(args), weights, ctypes.byref(attn_args), h.data_ptr(), delta.data_ptr())
        if status != 0:
            raise ValueError(f"decode_layers: a kernel refused its arguments (status {status}): a slot, context "
                             "length, block-table row or block id out of range, or a weight of the wrong shape")
        return delta

    def pack_linear(self, weight: torch.Tensor, swiglu: bool = False) -> torch.Tensor | None:
        """The layout `linear` reads: tiles of 16 outputs by pairs of inputs,
        [N / 16, K / 2, 16, 2]. None where the kernel can't take the weight (not bfloat16
        on CPU, N not a multiple of 16, K odd, or no AVX-512 BF16 here). swiglu: weight is
        [gate; up], its rows taken in `swiglu_order` (for `linear(..., swiglu=True)`)."""
        n, k = weight.shape
        if not self.has_linear or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or n % 16 or k % 2:
            return None
        if swiglu:
            weight = swiglu_order(weight)
        return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               after: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """x [rows, K] @ W.T (+ bias) for W packed by `pack_linear`; bfloat16 in and out.
        `after`: the packed weight of the linear the caller runs next (its first tiles are
        prefetched while this one finishes). swiglu: W is [gate; up] packed with
        swiglu=True, bias in `swiglu_order`; returns silu(gate) * up [rows, N / 2], bit for
        bit `silu_mul` of the plain product."""
        tiles, pairs, _, _ = packed.shape
        n, k = tiles * 16, pairs * 2
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or x.stride(1) != 1:
            raise ValueError(f"x must be bfloat16 [rows, {k}] with dense rows, got {x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous bfloat16 [{n}], got {bias.dtype} {tuple(bias.shape)}")
        width = n // 2 if swiglu else n
        y = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
        a_tiles, a_pairs = after.shape[:2] if after is not None else (0, 0)
        status = self._linear[swiglu](
            x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            width, x.shape[0], n, k, torch.get_num_threads(), None if after is None else after.data_ptr(),
            a_tiles * 16, a_pairs * 2)
        if status != 0:
            raise ValueError(f"linear: the kernel refused x {tuple(x.shape)} stride {x.stride()} for [{n}, {k}]"
                             if status == -3 else "linear: not built with AVX-512 BF16 on this CPU")
        return y


def swiglu_order(t: torch.Tensor) -> torch.Tensor:
    """The rows of [gate; up] (2 I rows, I a multiple of 8) interleaved by 8: gate rows
    0-7, up rows 0-7, gate rows 8-15, ... as linear.c's SwiGLU epilogue reads them."""
    return t.reshape(2, t.shape[0] // 16, 8, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _bind(lib: ctypes.CDLL, prefix: str, argtypes: list, restype: object,
          dtypes: dict[torch.dtype, str] = _DTYPES) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """The library's `prefix`_f32 / `prefix`_bf16 functions by dtype, typed for ctypes."""
    fns = {}
    for dtype, name in dtypes.items():
        fn = getattr(lib, f"{prefix}_{name}")
        fn.argtypes, fn.restype = argtypes, restype
        fns[dtype] = fn
    return fns


def _attention_args(
    q: torch.Tensor, pool: torch.Tensor, layer: int, block_table: torch.Tensor, token_index: torch.Tensor,
    rows: torch.Tensor, ctx_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> _AttnArgs:
    """paged_attention's arguments, checked (ValueError) as its docstring says."""
    _, heads, d = q.shape
    nb, nl, _, bs, kvh, d2 = pool.shape
    for name, t in (("q", q), ("out", out)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name} must have dense heads, got strides {t.stride()}")
    pool_ok = pool.dtype in (q.dtype, torch.float8_e4m3fn)
    if d2 != d or heads % kvh or not pool_ok or out.dtype != q.dtype or not pool.is_contiguous():
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match pool {tuple(pool.shape)} {pool.dtype}")
    index = [block_table, token_index, rows, ctx_lens]
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index):
        raise ValueError("block_table, token_index, rows and ctx_lens must be contiguous int64")
    return _AttnArgs(
        num_queries=token_index.numel(), num_heads=heads, num_kv_heads=kvh, head_dim=d, block_size=bs,
        q_token_stride=q.stride(0), out_token_stride=out.stride(0), block_stride=pool.stride(0),
        layer_offset=layer * pool.stride(1), v_offset=pool.stride(2), table_stride=block_table.shape[1],
        table_rows=block_table.shape[0], num_blocks=nb, num_tokens=min(q.shape[0], out.shape[0]),
        scale=scale, num_threads=torch.get_num_threads(), v_scale=1.0,
    )


def _check_rotary(
    qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor, pool: torch.Tensor,
    layer: int, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
) -> None:
    """rotary_store's arguments, checked (ValueError) as its docstring says."""
    tokens = qkv.shape[0]
    _, nl, _, _, kvh, d = pool.shape
    if kvh != kv_heads or qkv.shape[1] != (heads + 2 * kv_heads) * d or qkv.stride(1) != 1 or d % 2 or d > 1024:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {heads} + 2 x {kv_heads} heads of the pool's {d}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.shape != (tokens, 1, d) or t.stride(2) != 1 or t.stride(0) != cos.stride(0) or t.dtype != qkv.dtype:
            raise ValueError(f"{name} must be {qkv.dtype} [{tokens}, 1, {d}], got {t.dtype} {tuple(t.shape)}")
    if qkv.dtype != pool.dtype or not pool.is_contiguous() or not 0 <= layer < nl:
        raise ValueError(f"pool {pool.dtype} {tuple(pool.shape)} layer {layer} does not take qkv {qkv.dtype}")
    for name, t in (("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if t.shape != (tokens,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64 [{tokens}], got {t.dtype} {tuple(t.shape)}")


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built on first call in this process (None: see the log for why)."""
    try:
        return NativeKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernels unavailable, using the torch paths: %s", e)
        return None


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH; set CC to one")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for part in [version, " ".join(FLAGS), platform.machine(), _cpu_flags(), *(p.read_text() for p in SOURCES + HEADERS)]:
        key.update(part.encode())
    out_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitserve" / "kernels"
    target = out_dir / f"splitserve_kernels_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")  # concurrent builders each write their own
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native kernels: %s", target)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
