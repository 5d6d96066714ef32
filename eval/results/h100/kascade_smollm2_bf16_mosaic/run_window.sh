bash .device_tmp/eval_gpu.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site JSPARSE_CACHE=/tmp/jscache XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 GIT_COMMIT=$(cat .device_tmp/commit)
export XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_as_text"
T0=$(date +%s)
python -c "
import jax, jax.numpy as jnp
from pallas_kernels.anchor_attention import mgpu_prefill as m
q = jax.ShapeDtypeStruct((1, 4096, 9, 64), jnp.bfloat16); k = jax.ShapeDtypeStruct((1, 4096, 3, 64), jnp.bfloat16)
print('hopper', m.hopper(), 'smollm2 shapes take the Mosaic kernels at tile 32:', m.mgpu_supported(q, k, 32))"
timeout 280 python -m jsparse.cli eval --model /tmp/smollm2.gguf --dtype bfloat16 --methods dense,kascade --tasks passkey,ppl --lengths 4096 --samples 20 --ppl-variants prefill --artifact kascade=artifacts/smollm2/kascade --no-progress --out $OUT/kascade_bf16_4k > $OUT/k_a.log 2>&1 || echo kascade rc=$?
grep -v "^W0\|^I0" $OUT/k_a.log | tail -3 | cut -c1-250
sed -n '/## Results/,/## Achieved/p' $OUT/kascade_bf16_4k/summary.md 2>/dev/null | head -12
echo "HLO modules naming a Mosaic GPU kernel: $(grep -l 'mosaic_gpu' /tmp/xd/*.txt 2>/dev/null | wc -l); naming anchor_prefill_pool_mgpu: $(grep -l 'anchor_prefill_pool_mgpu' /tmp/xd/*.txt 2>/dev/null | wc -l)"
echo "took $(( $(date +%s) - T0 )) s"
rm -rf /tmp/xd
timeout $(( 540 - ($(date +%s) - T0) )) python -m jsparse.cli eval --model /tmp/smollm2.gguf --dtype bfloat16 --methods kascade --tasks passkey,ppl --lengths 4096 --samples 20 --ppl-variants prefill --artifact kascade=artifacts/smollm2/kascade --method-option kascade.tile=128 --no-progress --out $OUT/kascade_bf16_4k_tile128 > $OUT/k_b.log 2>&1 || echo kascade2 rc=$?
sed -n '/## Results/,/## Achieved/p' $OUT/kascade_bf16_4k_tile128/summary.md 2>/dev/null | head -10
echo "took $(( $(date +%s) - T0 )) s"
