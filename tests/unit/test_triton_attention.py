"""The Triton paged attention kernel against the reference, on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, in a process of its own: the interpreter is chosen when
the kernel is built). Skips where Triton is not installed; on a GPU, tests/gpu runs it for real."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from engine import triton_attention
from engine.kv_pool import KVLayout, KVPool
from tests.unit.test_native_attention import reference

kernels = triton_attention.load()
assert kernels is not None
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
    for heads, kv_heads, head_dim, block_size in ((4, 2, 8, 4), (8, 1, 32, 16), (6, 2, 64, 16), (10, 2, 24, 12)):
        pool = KVPool(KVLayout(3, block_size, kv_heads, head_dim, dtype), 40, "cpu")
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1)))
        g = torch.Generator().manual_seed(heads + head_dim)
        per_row = 48 // block_size + 1
        table = torch.randperm(40, generator=g)[: 3 * per_row].view(3, per_row).contiguous()
        rows = torch.tensor([0, 1, 1, 1, 2])  # request 1: a 3-token query
        ctx_lens = torch.tensor([1, 18, 19, 33, 48])  # one key; across block edges; whole blocks
        qkv = torch.randn(6, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
        q = qkv[:, :heads]  # tokens strided, as the fused qkv leaves them; token 4 is another group's
        out = torch.full((6, heads, head_dim), float("nan"), dtype=dtype)
        kernels.paged_attention(q, pool.tensor, 2, table, torch.tensor([0, 1, 2, 3, 5]), rows, ctx_lens, 0.3, out)
        want = reference(q[[0, 1, 2, 3, 5]], pool, 2, table, rows, ctx_lens, 0.3)
        torch.testing.assert_close(out[[0, 1, 2, 3, 5]].float(), want, atol=tol, rtol=tol)
        assert out[4].isnan().all()  # a token not in token_index is not written
print("ok")
"""


def test_the_triton_kernel_matches_the_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]
