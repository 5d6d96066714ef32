"""A Mosaic GPU (TMA + wgmma) GEMM for the decode step's few rows: y = x @ w[layer], H200 experiment (issue 24).

x [M, K] (M <= 64 rows, the decode step's padded token rows), w [L, K, N] the stacked weights read in place at a
runtime layer index (an int32 [1] operand, read by the kernel: no slice copy). Swapped operands: each CTA computes
out^T tile [tile_n, M] = w[l][k0:k1, n0:n0+tile_n]^T @ x[:, k0:k1]^T, the weight tile as wgmma's transposed A (M of
the instruction = tile_n, 64 per warpgroup), x as wgmma's N (8..64 rows). TMA streams the weight tiles through a
`max_concurrent_steps`-deep ring. Grid (N / tile_n, split_k); with split_k > 1 the kernel writes f32 partials
[split_k, N, M] summed by XLA. Returns y [M, N] in x's dtype.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class Config:
    tile_n: int = 64
    tile_k: int = 128
    split_k: int = 1
    stages: int = 4
    out_layout: str = "nm"  # "nm": [N, M] tiles, transposed by XLA; "mn_value": acc.T stored; "mn_ref": stored through a transposed SMEM ref
    pdl: bool = False  # stream the weights' first tiles before griddepcontrol.wait; x loaded whole after it


def mgpu_gemm(x, w, layer, config: Config = Config(), interpret=False):
    """x [M, K] @ w[layer] for w [L, K, N]; layer an int32 scalar. Returns [M, N] in x.dtype."""
    M, K = x.shape
    L, K2, N = w.shape
    c = config
    if K2 != K:
        raise ValueError(f"x has K={K}, w has K={K2}")
    if M % 8 or M > 64:
        raise ValueError(f"rows M={M}: expected a multiple of 8 up to 64")
    if N % c.tile_n or K % (c.tile_k * c.split_k):
        raise ValueError(f"N={N} must divide by tile_n={c.tile_n}, K={K} by tile_k*split_k={c.tile_k * c.split_k}")
    k_iters = K // (c.tile_k * c.split_k)
    n_tiles = N // c.tile_n
    out_dtype = jnp.float32 if c.split_k > 1 else x.dtype
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    def body(layer_gmem, x_gmem, w_gmem, o_gmem):
        ni = jax.lax.axis_index("n")
        si = jax.lax.axis_index("s")
        wl = w_gmem.at[layer_gmem[0]]
        w_spec = plgpu.BlockSpec((c.tile_k, c.tile_n), lambda k: (si * k_iters + k, ni), delay_release=1)  # the ring of weight tiles

        def acc_scope_pdl(acc_ref, x_smem, x_bar):
            kc = k_iters * c.tile_k

            def step(idx, w_smem):
                (k,) = idx

                @pl.when(k == 0)
                def _():
                    if not interpret:  # the interpreter has no rule for it
                        plgpu.griddepcontrol_wait()
                    plgpu.copy_gmem_to_smem(x_gmem.at[:, pl.ds(si * kc, kc)], x_smem, x_bar)
                    plgpu.barrier_wait(x_bar)
                plgpu.wgmma(acc_ref, w_smem.transpose((1, 0)),
                            x_smem.at[:, pl.ds(k * c.tile_k, c.tile_k)].transpose((1, 0)))

            plgpu.emit_pipeline(
                step, grid=(k_iters,),
                in_specs=[w_spec],
                max_concurrent_steps=c.stages,
            )(wl)
            return acc_ref[...]

        def acc_scope(acc_ref):
            if c.pdl:
                return pl.run_scoped(functools.partial(acc_scope_pdl, acc_ref),
                                     plgpu.SMEM((M, k_iters * c.tile_k), x.dtype), plgpu.Barrier(num_arrivals=1))
            plgpu.emit_pipeline(
                lambda _, x_smem, w_smem: plgpu.wgmma(acc_ref, w_smem.transpose((1, 0)),
                                                      x_smem.transpose((1, 0))),
                grid=(k_iters,),
                in_specs=[
                    plgpu.BlockSpec((M, c.tile_k), lambda k: (0, si * k_iters + k), delay_release=1),
                    w_spec,
                ],
                max_concurrent_steps=c.stages,
            )(x_gmem, wl)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((c.tile_n, M)))

        nm = c.out_layout == "nm"

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((c.tile_n, M) if nm else (M, c.tile_n), dtype=out_dtype))
        def store(o_smem):
            if nm:
                o_smem[...] = acc.astype(out_dtype)
                dst = o_gmem.at[si, pl.ds(ni * c.tile_n, c.tile_n)]
            else:
                if c.out_layout == "mn_value":
                    o_smem[...] = acc.astype(out_dtype).T
                else:
                    o_smem.transpose((1, 0))[...] = acc.astype(out_dtype)
                dst = o_gmem.at[si, :, pl.ds(ni * c.tile_n, c.tile_n)]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, dst)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((c.split_k, N, M) if c.out_layout == "nm" else (c.split_k, M, N), out_dtype),
        grid=(n_tiles, c.split_k),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}),
    )
    part = kernel(layer, x, w)
    if c.out_layout != "nm":
        return jnp.sum(part, axis=0).astype(x.dtype) if c.split_k > 1 else part[0]
    return jnp.sum(part.astype(jnp.float32), axis=0).T.astype(x.dtype) if c.split_k > 1 else part[0].T
