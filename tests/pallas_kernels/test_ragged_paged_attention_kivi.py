"""KIVI int4 / int2 pages: packing, the quantization error, the step's writes (page completion
and the residual seats, whatever the chunking), and every attention path against
dequantize-then-attend on the same pool."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    cpu,
    cpu_kivi_write,
    create_kivi_pool,
    dequantize_pool,
    ragged_paged_attention,
    write_to_kivi_pages,
    write_to_pages,
)
from pallas_kernels.ragged_paged_attention.kivi import dequantize, pack, quantize_pages, unpack

PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, GROUP = 4, 2, 16, 2


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_and_unpack_by_hand(bits):
    codes = jnp.asarray([[1, 2, 3, 0, 3, 3, 0, 1]], jnp.uint8)  # [1, 8]
    packed = pack(codes, bits)
    if bits == 4:
        np.testing.assert_array_equal(np.asarray(packed), [[0x21, 0x03, 0x33, 0x10]])
    else:
        np.testing.assert_array_equal(np.asarray(packed), [[0b00111001, 0b01001111]])
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits)), np.asarray(codes))


@pytest.mark.parametrize("bits", [4, 2])
def test_quantize_pages_error_is_half_a_step(bits):
    rng = np.random.default_rng(bits)
    rows = rng.normal(size=(3, PAGE_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    rows[0, :, 0, 5] += 20.0  # an outlier key channel: per-channel scales isolate it
    stored = quantize_pages(jnp.asarray(rows), bits, value_group=8)
    back = np.asarray(dequantize(*stored, bits))  # [3, Z, 2K, H]
    _, key_scales, _, value_scales, _ = (np.asarray(part, np.float32) for part in stored)
    key_step = np.broadcast_to(key_scales[:, None], back[:, :, 0::2].shape)
    value_step = np.repeat(value_scales, 8, axis=-1)  # [3, Z, K, H]
    # Half a step, plus float16 rounding of the scale and zero point (times the largest code).
    slack = 2 ** -10 * (2 ** bits) * (np.abs(rows).max() + 1)
    assert np.all(np.abs(back[:, :, 0::2] - rows[:, :, 0::2]) <= key_step / 2 + slack)
    assert np.all(np.abs(back[:, :, 1::2] - rows[:, :, 1::2]) <= value_step / 2 + slack)
    # The outlier channel does not spoil its neighbours' keys.
    assert np.abs(back[0, :, 0, 4] - rows[0, :, 0, 4]).max() < 0.6


def _write(pool_pages, pool, keys, values, table, starts, counts, seats):
    """One step writing tokens `starts[s] : starts[s] + counts[s]` of each sequence."""
    slots, rows_k, rows_v, cu = [], [], [], [0]
    for s, (start, count) in enumerate(zip(starts, counts, strict=True)):
        span = np.arange(start, start + count)
        slots += list(table[s][span // PAGE_SIZE] * PAGE_SIZE + span % PAGE_SIZE)
        rows_k.append(keys[s][span])
        rows_v.append(values[s][span])
        cu.append(cu[-1] + count)
    slots.append(-1)  # a padding token
    rows_k.append(np.zeros((1, NUM_KV_HEADS, HEAD_DIM), np.float32))
    rows_v.append(np.zeros((1, NUM_KV_HEADS, HEAD_DIM), np.float32))
    kv_lens = np.asarray([start + count for start, count in zip(starts, counts, strict=True)],
                         np.int32)
    return write_to_kivi_pages(pool_pages, pool, jnp.asarray(np.concatenate(rows_k)),
                               jnp.asarray(np.concatenate(rows_v)),
                               jnp.asarray(np.asarray(slots, np.int32)), jnp.asarray(kv_lens),
                               jnp.asarray(np.asarray(cu, np.int32)),
                               jnp.asarray(np.asarray(seats, np.int32)), layer=1)


def _sequences(rng, lengths, pages_per_seq):
    num_pages = 1 + len(lengths) * pages_per_seq
    free = list(rng.permutation(np.arange(1, num_pages)))
    table = np.asarray([[free.pop() for _ in range(pages_per_seq)] for _ in lengths], np.int32)
    keys = [rng.normal(size=(n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
    values = [rng.normal(size=(n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in lengths]
    return num_pages, table, keys, values


@pytest.mark.parametrize("writer", ["cpu", "xla"])
@pytest.mark.parametrize("bits", [4, 2])
def test_writes_do_not_depend_on_the_chunking(bits, writer):
    # The same tokens written in one step or in steps of 1-5 tokens give the same pool: a page
    # is quantized once, when it fills, from its residual rows and the step's rows (a chunk
    # that completes a page and starts the next reads the seat before overwriting it). On
    # XLA:CPU the C++ handler writes (`cpu_kivi_write`); the XLA path is the other writer.
    with contextlib.nullcontext() if writer == "cpu" else cpu_kivi_write.disabled():
        _check_chunking(bits)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's handler")
@pytest.mark.parametrize(("bits", "value_group"), [(4, 8), (2, 4)])
def test_the_cpu_writer_stores_what_the_xla_writer_stores(bits, value_group):
    rng = np.random.default_rng(5)
    lengths = [11, 8, 3, 16]
    num_pages, table, keys, values = _sequences(rng, lengths, pages_per_seq=4)
    keys[0][:, 0, 3] += 30.0  # an outlier channel, and a constant one (scale 0)
    values[1][:] = 0.5
    seats = [2, 0, 1, 4]
    written = {}
    for writer in ("cpu", "xla"):
        pages, pool = create_kivi_pool(2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, bits,
                                       value_group, 5)
        with contextlib.nullcontext() if writer == "cpu" else cpu_kivi_write.disabled():
            assert cpu_kivi_write.supports(PAGE_SIZE) == (writer == "cpu")
            pages, pool = _write(pages, pool, keys, values, table, [0] * 4, [5, 8, 1, 12], seats)
            pages, pool = _write(pages, pool, keys, values, table, [5, 8, 1, 12], [6, 0, 2, 4],
                                 seats)
        written[writer] = (pages, *pool)
    for cpu_array, xla_array in zip(written["cpu"], written["xla"], strict=True):
        np.testing.assert_array_equal(np.asarray(cpu_array), np.asarray(xla_array))


def _check_chunking(bits):
    rng = np.random.default_rng(0)
    lengths = [11, 8, 3]
    num_pages, table, keys, values = _sequences(rng, lengths, pages_per_seq=4)
    seats = [2, 0, 1]

    def fresh():
        return create_kivi_pool(2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, bits, 8, 3)

    pages, pool = _write(*fresh(), keys, values, table, [0, 0, 0], lengths, seats)
    chunked_pages, chunked = fresh()
    done = [0, 0, 0]
    while done != lengths:
        counts = [min(int(rng.integers(1, 6)), n - d) for n, d in zip(lengths, done, strict=True)]
        chunked_pages, chunked = _write(chunked_pages, chunked, keys, values, table, done,
                                        counts, seats)
        done = [d + c for d, c in zip(done, counts, strict=True)]
    np.testing.assert_array_equal(np.asarray(chunked_pages), np.asarray(pages))
    for name in ("key_scales", "key_zeros", "value_scales", "value_zeros"):
        np.testing.assert_array_equal(np.asarray(getattr(chunked, name)),
                                      np.asarray(getattr(pool, name)))
    # The partial pages' rows (sequence 0: 3 rows, sequence 2: 3 rows) are exact; sequence 1
    # ends on a page boundary (its seat holds rows of no live page).
    floats = np.asarray(dequantize_pool(pages, pool, jnp.asarray(table),
                                        jnp.asarray(lengths, jnp.int32), jnp.asarray(seats),
                                        jnp.asarray([3], jnp.int32)))[1]  # [P, Z, 2K, H]
    np.testing.assert_array_equal(floats[table[0, 2], :3, 0::2], keys[0][8:])
    np.testing.assert_array_equal(floats[table[2, 0], :3, 1::2], values[2])
    # Full pages round within a quantization step of the float rows.
    error = np.abs(floats[table[1, 1], :, 0::2] - keys[1][4:8]).max()
    assert 0 < error < (1.0 if bits == 4 else 3.0)
    assert not np.any(np.asarray(pages)[0])  # layer 0 untouched


def _float_pool(rng, query_lens, context_lens, pages_per_seq):
    """The float32 stacked pool `[2, P, Z, 2K, H]` (layer 1) of `_kivi_case`'s rows, drawn
    from a generator in the same state."""
    lengths = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    num_pages, table, keys, values = _sequences(rng, lengths, pages_per_seq)
    pool = jnp.zeros((2, num_pages, PAGE_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM), jnp.float32)
    for s, length in enumerate(lengths):
        span = np.arange(length)
        slots = jnp.asarray(table[s][span // PAGE_SIZE] * PAGE_SIZE + span % PAGE_SIZE)
        pool = write_to_pages(pool, jnp.asarray(keys[s]), jnp.asarray(values[s]), slots,
                              layer=1)
    return pool


def _kivi_case(rng, bits, query_lens, context_lens, pages_per_seq, value_group=8):
    """A KIVI pool written step by step (the context, then this step's tokens), and the
    attention inputs of the last step."""
    lengths = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    num_pages, table, keys, values = _sequences(rng, lengths, pages_per_seq)
    seats = list(rng.permutation(len(lengths) + 1)[:len(lengths)])
    pages, pool = create_kivi_pool(2, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, bits,
                                   value_group, len(lengths) + 1)
    pages, pool = _write(pages, pool, keys, values, table, [0] * len(lengths), context_lens,
                         seats)
    pages, pool = _write(pages, pool, keys, values, table, context_lens, query_lens, seats)
    num_heads = NUM_KV_HEADS * GROUP
    queries = rng.normal(size=(sum(query_lens) + 2, num_heads, HEAD_DIM)).astype(np.float32)
    queries[sum(query_lens):] = 0
    cu = np.concatenate([[0], np.cumsum(query_lens), [sum(query_lens)]]).astype(np.int32)
    table = np.concatenate([table, np.zeros((1, pages_per_seq), np.int32)])  # a padding row
    batch = (jnp.asarray(np.asarray(lengths + [0], np.int32)), jnp.asarray(table),
             jnp.asarray(cu), jnp.asarray([len(lengths)], jnp.int32))
    return jnp.asarray(queries), pages, pool, batch, jnp.asarray(np.asarray(seats + [0],
                                                                             np.int32))


@pytest.mark.parametrize("implementation", ["reference", "xla", "interpret"])
@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_pool_equals_its_dequantized_float_pool(implementation, bits):
    rng = np.random.default_rng(10 + bits)
    # Decodes that complete a page or not, a chunk reaching back over a partial page, a
    # prefill of several pages with a partial tail.
    query_lens, context_lens = [1, 1, 5, 9, 1], [3, 6, 6, 0, 12]
    queries, pages, pool, batch, seats = _kivi_case(rng, bits, query_lens, context_lens, 6)
    kv_lens, table, cu, num_seqs = batch
    floats = dequantize_pool(pages, pool, table, kv_lens, seats, num_seqs)  # [L, P, Z, 2K, H]
    for window in (None, 5):
        expected = ragged_paged_attention(queries, floats, kv_lens, table, cu, num_seqs,
                                          sm_scale=0.3, sliding_window=window, layer=1,
                                          implementation="reference")
        got = ragged_paged_attention(queries, pages, kv_lens, table, cu, num_seqs,
                                     sm_scale=0.3, sliding_window=window, layer=1,
                                     kv_scales=pool, residual_slots=seats,
                                     implementation=implementation)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5)


@pytest.mark.parametrize(("bits", "tolerance"), [(4, 0.15), (2, 0.6)])
def test_kivi_attention_is_close_to_float_attention(bits, tolerance):
    rng = np.random.default_rng(3)
    query_lens, context_lens = [1, 4, 1], [30, 9, 17]
    queries, pages, pool, batch, seats = _kivi_case(rng, bits, query_lens, context_lens, 9)
    kv_lens, table, cu, num_seqs = batch
    # The same draws as `_kivi_case`'s (its first use of the generator), written as floats.
    float_pool = _float_pool(np.random.default_rng(3), query_lens, context_lens, 9)
    exact = ragged_paged_attention(queries, float_pool, kv_lens, table, cu, num_seqs,
                                   sm_scale=0.25, layer=1, implementation="reference")
    approximate = ragged_paged_attention(queries, pages, kv_lens, table, cu, num_seqs,
                                         sm_scale=0.25, layer=1, kv_scales=pool,
                                         residual_slots=seats, implementation="xla")
    exact, approximate = np.asarray(exact), np.asarray(approximate)
    relative = np.abs(approximate - exact).max() / np.abs(exact).max()
    assert 0 < relative < tolerance, relative


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's kernel")
@pytest.mark.parametrize(("bits", "head_dim", "value_group"),
                         [(4, 16, 8), (2, 16, 8), (4, 40, 4), (2, 12, 4)])
def test_the_cpu_kernel_equals_the_xla_loop(bits, head_dim, value_group, monkeypatch):
    # The C++ decode walk dequantizes each page (16 codes at a time for int4 and 8 for int2,
    # then a scalar tail: head_dim 40 and 12) and reads a partial last page from the residual.
    monkeypatch.setattr(sys.modules[__name__], "HEAD_DIM", head_dim)
    rng = np.random.default_rng(bits + head_dim)
    query_lens, context_lens = [1, 1, 1, 3, 1], [3, 8, 13, 6, 0]
    queries, pages, pool, batch, seats = _kivi_case(rng, bits, query_lens, context_lens, 5,
                                                    value_group)
    kv_lens, table, cu, num_seqs = batch

    def attend(window, soft_cap):
        return jax.jit(lambda *args: ragged_paged_attention(
            *args, sm_scale=0.3, sliding_window=window, soft_cap=soft_cap, layer=1,
            kv_scales=pool, residual_slots=seats, implementation="xla"))(
            queries, pages, kv_lens, table, cu, num_seqs)

    assert "jaxinfer_DecodeAttentionKivi" in jax.jit(lambda q: ragged_paged_attention(
        q, pages, kv_lens, table, cu, num_seqs, sm_scale=0.3, layer=1, kv_scales=pool,
        residual_slots=seats, implementation="xla")).lower(queries).as_text()
    for window, soft_cap in ((None, None), (5, None), (None, 4.0)):
        kernel = np.asarray(attend(window, soft_cap))
        with cpu.disabled():
            loop = np.asarray(attend(window, soft_cap))
        np.testing.assert_allclose(kernel, loop, atol=2e-5, rtol=2e-5)
